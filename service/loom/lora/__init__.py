"""LoRA adapters: many per batch, loaded and unloaded while serving.

- :mod:`.peft_adapter`: a PEFT directory read and checked (config fields, factor shapes, rank);
- :mod:`.layers`: each adaptable linear layer's slot tables on the device, the step's row ->
  slot map, and the delta added to the base layer's output (torch path on the CPU; a Triton
  kernel from ``plugins/lora`` on CUDA);
- :mod:`.manager`: the engine's side: names -> slots, loads off the step loop, unloads.

The front end's side (RPCs, validation, metrics) is in ``loom.server``; see docs/lora.md.
"""
