"""The tensor-parallel ranks' command channel: the shared-memory ring against a gloo broadcast.

Two processes (rank 0 writes, rank 1 reads), payloads of the pickled sizes of decode-step plans
(1.8, 11 and 44 kB for 8, 64 and 256 sequences, docs/scaling.md), sent at once or after 3 ms of
rank 0's "host work" (the reader then waits in its sleeps), each command stamped with
``time.monotonic_ns()`` (system-wide on Linux) when rank 0 starts sending it and compared with
the time rank 1 has it unpickled. The two channels alternate in blocks of ``--block``
commands; a command is sent only once the previous one has arrived (as the engine sends one a
step). Prints the median one-way latency of each; ``--out`` writes them as JSON.

    python scripts/bench_command_ring.py [--out bench/results/cpu-command-ring.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

SIZES = {"8 sequences": 1_800, "64 sequences": 11_000, "256 sequences": 44_000}
# (payload, rank 0's host work before each send, ms): the reader waits that long for the command
CASES = [(name, size, 0.0) for name, size in SIZES.items()] + [("64 sequences, 3 ms host work", 11_000, 3.0)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(rank: int, port: int, ring_path: str, blocks: int, block: int, out: Any) -> None:
    import torch.distributed as dist

    from loom.distributed.command_ring import CommandRing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ring = CommandRing(Path(ring_path), 2, rank)
    lat: dict[str, dict[str, list[float]]] = {name: {"gloo": [], "ring": []} for name, _, _ in CASES}
    for name, size, work_ms in CASES:
        payload = bytes(size)
        for _ in range(blocks):
            for channel in ("gloo", "ring"):
                for _ in range(block):
                    dist.barrier()  # one command at a time, as a step sends one
                    if rank == 0:
                        time.sleep(work_ms / 1e3)  # the engine scheduling the step
                        obj = (time.monotonic_ns(), payload)
                        if channel == "gloo":
                            dist.broadcast_object_list([obj], src=0)
                        else:
                            ring.send(obj, lambda o: dist.broadcast_object_list([o], src=0), lambda: None)
                    else:
                        if channel == "gloo":
                            box: list[Any] = [None]
                            dist.broadcast_object_list(box, src=0)
                            sent = box[0][0]
                        else:
                            sent = ring.recv(lambda: None)[0]
                        lat[name][channel].append((time.monotonic_ns() - sent) / 1e3)
    if rank == 1:
        out.put(lat)
    ring.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block", type=int, default=50)
    args = parser.parse_args()
    from loom.distributed.command_ring import CommandRing

    ring = CommandRing.create(2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_run, args=(r, port, str(ring.path), args.blocks, args.block, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    lat = out.get(timeout=600)
    for p in procs:
        p.join()
    ring.close(unlink=True)
    report: dict[str, Any] = {"commands_per_channel_and_size": args.blocks * args.block, "cores": os.cpu_count()}
    sizes = {name: size for name, size, _ in CASES}
    for name, by in lat.items():
        g, r = statistics.median(by["gloo"]), statistics.median(by["ring"])
        report[name] = {"bytes": sizes[name], "gloo_median_us": g, "ring_median_us": r, "gloo_p99_us":
                        sorted(by["gloo"])[int(0.99 * len(by["gloo"]))], "ring_p99_us":
                        sorted(by["ring"])[int(0.99 * len(by["ring"]))]}
        print(f"{name} ({sizes[name]:,} B): gloo broadcast {g:.0f} us, shared-memory ring {r:.0f} us "
              f"(median one-way, {args.blocks * args.block} commands each)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
