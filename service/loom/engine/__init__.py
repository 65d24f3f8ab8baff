"""The engine core: sequences, KV block manager, scheduler, model runner, sampler, step loop."""
