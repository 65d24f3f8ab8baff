"""Keep Python's cyclic garbage collector off the long-lived objects of a started process.

After start-up a process holds hundreds of thousands of objects that live until it exits
(torch modules, transformers and tokenizer state, protobuf descriptors). A full (generation 2)
collection walks all of them: measured here, 313k tracked objects in the engine process and
stalls of up to 118 ms on 2 cores; on the H200 host two stalls of 217 and 293 ms showed in one
llama-1b W2 run, with 512 sequences waiting on each. ``gc.freeze()`` moves every object alive
now into a permanent generation the collector never scans, so later collections only see what
serving allocates (outputs, per-request state). vLLM and SGLang do the same after start-up.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections. Returns how
    many objects were frozen. Call it when start-up is over (model loaded, warm-up done)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
