"""Built-in LoRA kernels for CUDA (``sgmv_triton.py``): the worker takes them by module name when
it serves adapters on a GPU; on the CPU the torch path of ``loom.lora.layers`` runs instead.
No plugin hook yet: a third-party kernel would need a contract in ``loom.plugin_api`` first."""
