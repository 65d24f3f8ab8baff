"""The CPU KV pool's size: what the limits need, within a share of the available memory, never
below one full-length request; --max-batch-total-tokens overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.engine import kv_pool_sizing
from loom.engine.kv_pool_sizing import available_memory_bytes, kv_bytes_per_token, size_cpu_kv_pool

# SmolLM2-135M in fp32: 30 layers x 3 KV heads x 64 dims, K and V, 4 bytes
SMOL_PER_TOKEN = kv_bytes_per_token(30, 3, 64, 4)
GIB = 1 << 30


def size(**kw: object) -> kv_pool_sizing.KvPoolSize:
    args: dict[str, object] = dict(block_size=16, max_model_len=4096, bytes_per_token=SMOL_PER_TOKEN,
                                   explicit_tokens=None, sequences=4, max_batch_size=None, memory_fraction=0.25,
                                   available_bytes=16 * GIB)
    return size_cpu_kv_pool(**{**args, **kw})  # type: ignore[arg-type]


def test_the_default_model_gets_four_full_length_sequences() -> None:
    assert SMOL_PER_TOKEN == 46080  # 45 KiB a token
    pool = size()
    assert (pool.tokens, pool.blocks) == (16384, 1024)
    assert pool.bytes == 16384 * 46080 and pool.bytes >> 20 == 720  # was 65,536 tokens: 2,880 MiB
    assert pool.reason == "4 sequences of max_total_tokens 4096, within 25% of the 16384 MiB available"


def test_a_smaller_max_batch_size_means_fewer_sequences() -> None:
    pool = size(max_batch_size=2)
    assert pool.tokens == 2 * 4096 and "(--max-batch-size)" in pool.reason
    assert size(max_batch_size=64).tokens == 4 * 4096  # a large one does not grow the pool


def test_the_memory_budget_caps_it_in_whole_blocks() -> None:
    available = 1 * GIB  # 25%: 256 MiB = 5825 tokens of 45 KiB
    pool = size(available_bytes=available)
    assert pool.tokens == (available // 4 // SMOL_PER_TOKEN) // 16 * 16 == 5824
    assert pool.bytes <= available // 4 and pool.tokens >= 4096
    assert pool.reason == "25% of the 1024 MiB available (less than 4 sequences of max_total_tokens 4096)"


def test_never_below_one_full_length_request() -> None:
    pool = size(available_bytes=256 << 20)  # a budget of 64 MiB: 1456 tokens
    assert pool.tokens == 4096
    assert pool.reason.startswith("one sequence of max_total_tokens 4096, more than 25% of the 256 MiB")
    odd = size(available_bytes=128 << 20, max_model_len=1000)  # 728 tokens fit: one sequence, whole blocks
    assert odd.tokens == 1008 and odd.blocks == 63
    assert size(available_bytes=None).tokens == 16384  # unknown memory: what the limits need


def test_max_batch_total_tokens_overrides() -> None:
    pool = size(explicit_tokens=65536, available_bytes=1 * GIB)
    assert pool.tokens == 65536 and pool.reason == "--max-batch-total-tokens"
    assert size(explicit_tokens=100).tokens == 96  # whole blocks


def test_available_memory_reads_meminfo_and_a_cgroup_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = available_memory_bytes()
    assert real is not None and real > 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   8000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    original = Path

    def fake_path(*parts: str) -> Path:
        text = "/".join(parts)
        if text == "/proc/meminfo":
            return meminfo
        if text == "/sys/fs/cgroup":
            return cgroup
        return original(*parts)

    monkeypatch.setattr(kv_pool_sizing, "Path", fake_path)
    assert available_memory_bytes() == 8000000 * 1024
    (cgroup / "memory.max").write_text("max\n")  # v2, no limit
    (cgroup / "memory.current").write_text("1000\n")
    assert available_memory_bytes() == 8000000 * 1024
    (cgroup / "memory.max").write_text(f"{2 * GIB}\n")  # a container of 2 GiB, 0.5 GiB used
    (cgroup / "memory.current").write_text(f"{GIB // 2}\n")
    assert available_memory_bytes() == 2 * GIB - GIB // 2
