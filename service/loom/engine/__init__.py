"""The engine core: sequences, KV block manager, scheduler, step planner, output processor, step loop (the device side: loom.worker; sampling: loom.sample)."""
