"""What a process pays to be woken: a ping-pong of two processes over a socket pair, as the engine
and its grammar process talk (#17), each side blocking in the kernel for the other's message or
polling for it first (``LOOM_GRAMMAR_SPIN_US``).

The child answers each message after ``--child-us`` of busy work (a fill); the parent does
``--parent-us`` of busy work between round trips (the rest of an engine step). Reported: the
round trip minus the child's work, median and p90, for each way in turn, ``--rounds`` times.

    python3 scripts/bench_wakeup.py [--spin-us 0,2000] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MESSAGE = b"x" * 900  # about a 64-row step's pickled tokens and layout


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wait(conn: Connection, spin_s: float) -> None:
    end = time.perf_counter() + spin_s
    while spin_s and not conn.poll(0) and time.perf_counter() < end:
        pass
    conn.poll(None)


def ping_pong(spin_us: int, trips: int, child_us: float, parent_us: float) -> dict[str, Any]:
    spin_s = spin_us / 1e6
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: answer each message after its work
        theirs = Connection(b.detach())
        for _ in range(trips):
            _wait(theirs, spin_s)
            msg = theirs.recv_bytes()
            _busy(child_us / 1e6)
            theirs.send_bytes(msg)
        os._exit(0)
    b.close()
    ours = Connection(a.detach())
    over: list[float] = []
    for _ in range(trips):
        started = time.perf_counter()
        ours.send_bytes(MESSAGE)
        _wait(ours, spin_s)
        ours.recv_bytes()
        over.append(time.perf_counter() - started - child_us / 1e6)
        _busy(parent_us / 1e6)
    os.waitpid(pid, 0)
    ours.close()
    over.sort()
    return {"spin_us": spin_us, "trips": trips, "overhead_median_us": round(over[trips // 2] * 1e6, 1),
            "overhead_p90_us": round(over[int(trips * 0.9)] * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spin-us", default="0,2000", help="the ways to wait, in turn (0: block at once)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trips", type=int, default=3000)
    ap.add_argument("--child-us", type=float, default=200.0)
    ap.add_argument("--parent-us", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs = []
    for _ in range(args.rounds):
        for spin in (int(v) for v in args.spin_us.split(",")):
            run = ping_pong(spin, args.trips, args.child_us, args.parent_us)
            print(json.dumps(run))
            runs.append(run)
    if args.out is not None:
        result = {"command": "python3 scripts/bench_wakeup.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
            "cpus": os.cpu_count(), "runs": runs}
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
