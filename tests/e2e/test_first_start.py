"""A first start (nothing converted yet) with --json-output: every line is JSON, and the GGUF
conversion says what it does, how long it usually takes, and how far it is while it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loom_client.v1 import generation_pb2 as pb

from .server_process import start_server

pytestmark = pytest.mark.e2e

CONVERTING = "converting the GGUF file into the cache, once per file"


def test_first_start_logs_json_only_and_reports_the_conversion(tmp_path: Path, server_logs: Path) -> None:
    cache = tmp_path / "fresh-cache"
    # A progress line every second, so even the short per-tensor phases (2-5 s here) show theirs.
    server = start_server(None, server_logs, "first-start-json", "--json-output", "--max-batch-total-tokens", "4096",
                          env={"LOOM_CACHE_DIR": str(cache), "LOOM_PROGRESS_INTERVAL_S": "1"})
    try:
        reply = server.stub.Generate(pb.GenerateRequest(text="Hello", parameters=pb.Parameters(
            stopping=pb.StoppingParameters(max_new_tokens=2))), timeout=60)
        assert reply.completions[0].generated_tokens == 2
    finally:
        assert server.stop() == 0
    text = server.log_text()
    assert "\r" not in text  # no progress bar anywhere
    entries: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"line {number} of the log is not JSON: {line!r}")
    assert all(e.get("process") in ("server", "engine") for e in entries), [e for e in entries if "process" not in e]
    events = [e["event"] for e in entries]
    announced = [e for e in entries if e["event"].startswith(CONVERTING + " (usually about ")]
    assert len(announced) == 1 and announced[0]["usual_s"] > 0 and announced[0]["gguf"].endswith(".gguf")
    assert Path(announced[0]["cache_dir"]).parent == cache / "gguf"
    progress = [e for e in entries if e["event"] == f"{CONVERTING}: still running"]
    assert progress and all(e["elapsed_s"] > 0 for e in progress)
    phases = {e["phase"] for e in progress}
    assert "reading the GGUF file" in phases
    counted = [e for e in progress if "total" in e]
    assert counted and all(0 <= e["done"] <= e["total"] for e in counted)  # tensors done of all
    done = [e for e in entries if e["event"] == f"{CONVERTING}: done"]
    assert len(done) == 1 and done[0]["duration_s"] > 0
    assert events.index(announced[0]["event"]) < events.index(done[0]["event"]) < events.index("serving")
