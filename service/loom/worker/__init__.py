"""The worker: one device's model, KV pool, model runner, CUDA graphs and staging; runs step plans."""
