"""The converted-GGUF cache: keyed on the file's content, stale entries of a model removed,
concurrent conversions safe (the conversion itself is replaced by a fake that writes the files)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loom.model_loader import cache_root, converted_gguf_dir, gguf_cache

ROOT = Path(__file__).resolve().parents[2]


def _fake_convert(calls: list[Path]) -> Callable[[Path, Path], None]:
    def convert(gguf: Path, out: Path, *args: Any) -> None:
        calls.append(gguf)
        for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
            (out / name).write_text("{}")

    return convert


class _Recorder:
    """Stands in for the module's structlog logger: (event, fields) of every line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    info = warning = debug = _record


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    made: list[Path] = []
    monkeypatch.setattr(gguf_cache, "_convert", _fake_convert(made))
    return made


def _gguf(path: Path, size: int = 4096, seed: int = 0) -> Path:
    path.write_bytes(b"GGUF" + bytes((seed + i * 7) % 251 for i in range(size - 4)))
    return path


def test_touching_the_file_does_not_convert_again(tmp_path: Path, calls: list[Path]) -> None:
    gguf = _gguf(tmp_path / "m.gguf")
    first = converted_gguf_dir(gguf)
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns + 10**9, st.st_mtime_ns + 10**9))  # a reinstall: new mtime, same bytes
    assert converted_gguf_dir(gguf) == first and len(calls) == 1
    # a copy elsewhere (another venv) is the same content: the same entry
    other = tmp_path / "venv2"
    other.mkdir()
    copy = other / "m.gguf"
    copy.write_bytes(gguf.read_bytes())
    assert converted_gguf_dir(copy) == first and len(calls) == 1


def test_changed_bytes_convert_again_and_remove_the_stale_entry(tmp_path: Path, calls: list[Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    logged = _Recorder()
    monkeypatch.setattr(gguf_cache, "log", logged)
    gguf = _gguf(tmp_path / "m.gguf")
    first = converted_gguf_dir(gguf)
    # an entry of the old mtime-keyed layout, another model's entry, and a file that is no entry
    old_layout = cache_root() / "m-4096-1796165678450176035-v2"
    old_layout.mkdir()
    (old_layout / "model.safetensors").write_bytes(b"x" * 100)
    other_model = cache_root() / "m2-4096-0123456789abcdef-v2"
    other_model.mkdir()
    data = bytearray(gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte in the middle differs
    gguf.write_bytes(bytes(data))
    second = converted_gguf_dir(gguf)
    assert second != first and len(calls) == 2
    assert not first.exists() and not old_layout.exists()
    assert other_model.is_dir() and second.is_dir()
    assert sorted(p.name for p in cache_root().iterdir() if p.is_dir()) == sorted([second.name, other_model.name])
    removed = [fields for event, fields in logged.lines if "stale" in event]
    assert sorted(r["path"] for r in removed) == sorted([str(first), str(old_layout)])
    assert sum(r["bytes"] for r in removed) >= 100 and {r["kept"] for r in removed} == {second.name}


def test_key_is_content_digest_and_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = _gguf(tmp_path / "m.gguf", size=64 << 10)
    key = gguf_cache.cache_key(gguf)
    assert key.startswith(f"m-{64 << 10}-") and key.endswith(f"-v{gguf_cache.CONVERTER_VERSION}")
    # big files: header, evenly spaced chunks and the tail are hashed, not every byte
    monkeypatch.setattr(gguf_cache, "FULL_HASH_MAX_BYTES", 16 << 10)
    monkeypatch.setattr(gguf_cache, "SAMPLE_BYTES", 1 << 10)
    monkeypatch.setattr(gguf_cache, "HEADER_BYTES", 4 << 10)
    sampled = gguf_cache.cache_key(gguf)
    assert sampled != key
    for offset in (0, (4 << 10) - 1, (64 << 10) - 1):  # the header's first and last byte, the last byte
        data = bytearray(gguf.read_bytes())
        data[offset] ^= 0xFF
        changed = tmp_path / "changed.gguf"
        changed.write_bytes(bytes(data))
        assert gguf_cache.cache_key(changed).replace("changed-", "m-") != sampled, offset


_CONVERTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from loom.model_loader import gguf_cache

    gguf, log, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

    def slow_convert(src, out, *args):
        with open(log, "a") as f:
            f.write("convert\\n")
        time.sleep(1.5)  # long enough for the other process to arrive
        for name in gguf_cache._REQUIRED:
            (out / name).write_text("{}")

    gguf_cache._convert = slow_convert
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    print(gguf_cache.converted_gguf_dir(gguf), flush=True)
""")


def test_two_processes_converting_at_once_convert_once(tmp_path: Path) -> None:
    gguf = _gguf(tmp_path / "m.gguf")
    log, go = tmp_path / "conversions.log", tmp_path / "go"
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "service"), str(ROOT / "clients" / "python" / "src")])}
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERTER, str(gguf), str(log), str(go)],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    started = time.monotonic()
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        outputs.append(out)
    assert time.monotonic() - started < 60
    assert log.read_text().count("convert") == 1
    results = [out.strip().splitlines()[-1] for out in outputs]  # the directory, after the log lines
    assert results[0] == results[1]
    assert sum("another process is converting this model; waiting for it" in out for out in outputs) == 1
    final = Path(results[0])
    assert all((final / name).is_file() for name in gguf_cache._REQUIRED)
    assert [p.name for p in final.parent.iterdir() if p.is_dir()] == [final.name]  # no temp dir left
