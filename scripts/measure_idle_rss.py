"""Idle memory of a ``loom serve`` on the default model: the engine's and the front end's RSS once
the server reports SERVING, with the default CPU KV pool and with a given pool size beside it.

    python scripts/measure_idle_rss.py [--log-dir DIR] [--pool-tokens 65536]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.source_tree import make_importable

make_importable()

from e2e.server_process import engine_pid, rss_mib, start_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-dir", default=None, help="server logs here (default: a temporary folder)")
    parser.add_argument("--pool-tokens", type=int, default=65536,
                        help="the --max-batch-total-tokens measured beside the default (65,536: the old CPU default)")
    args = parser.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="loom-rss-"))
    for extra in ((), ("--max-batch-total-tokens", str(args.pool_tokens))):
        server = start_server(None, log_dir, "rss" + "-".join(extra), *extra)
        try:
            time.sleep(3)  # past the warm-up's last allocations
            engine = engine_pid(server.proc.pid)
            print(f"{' '.join(extra) or '(default pool)'}: engine RSS {rss_mib(engine):.0f} MiB, "
                  f"front end RSS {rss_mib(server.proc.pid):.0f} MiB", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
