"""The engine core: sequences, KV block manager, scheduler, model runner, step loop (sampling: loom.sample)."""
