"""The shared-memory command ring of the tensor-parallel ranks (loom/distributed/command_ring.py):
commands arrive whole and in order across processes, a command larger than a slot takes the
fallback path, the writer never overwrites a command a reader has not taken, and it gives up
when told a rank is lost."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from loom.distributed.command_ring import CommandRing, RingAborted, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the ring is used on x86-64 only")


def _reader(path: str, world: int, rank: int, count: int, fallback: Any, out: Any) -> None:
    ring = CommandRing(Path(path), world, rank, num_slots=4, slot_bytes=4096)
    got = [ring.recv(fallback.recv) for _ in range(count)]
    out.put((rank, got))
    ring.close()


def test_commands_arrive_whole_and_in_order_in_other_processes() -> None:
    world, count = 3, 200
    ring = CommandRing.create(world, num_slots=4, slot_bytes=4096)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(world - 1)]  # the fallback channel, one per reader
    procs = [ctx.Process(target=_reader, args=(str(ring.path), world, r, count, pipes[r - 1][1], out))
             for r in range(1, world)]
    for p in procs:
        p.start()
    sent = []
    for i in range(count):
        # every 25th command is larger than a slot: announced in the ring, sent by the fallback
        obj = {"seq": i, "payload": bytes(10_000) if i % 25 == 0 else bytes(i % 300), "rows": list(range(i % 17))}

        def large(o: Any) -> None:
            for send_end, _ in pipes:
                send_end.send(o)

        ring.send(obj, large, lambda: None)
        sent.append(obj)
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    assert all(results[r] == sent for r in range(1, world))
    ring.close(unlink=True)
    assert not ring.path.exists()


def test_the_writer_waits_for_a_lagging_reader_and_gives_up_when_told() -> None:
    ring = CommandRing.create(2, num_slots=4, slot_bytes=1024)
    reader = CommandRing(ring.path, 2, 1, num_slots=4, slot_bytes=1024)
    for i in range(4):  # fills every slot: the reader has taken none
        ring.send(i, lambda o: None, lambda: None)
    with pytest.raises(RingAborted, match="rank 1 was killed"):
        ring.send(4, lambda o: None, lambda: "tensor-parallel rank 1 was killed")
    assert reader.recv(lambda: None) == 0  # the reader takes the oldest: its slot is free again
    ring.send(4, lambda o: None, lambda: None)
    assert [reader.recv(lambda: None) for _ in range(4)] == [1, 2, 3, 4]
    reader.close()
    ring.close(unlink=True)


def test_a_ring_needs_a_reader() -> None:
    with pytest.raises(ValueError, match="at least one reader"):
        CommandRing.create(1)
