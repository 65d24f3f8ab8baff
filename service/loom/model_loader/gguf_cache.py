"""Converting a GGUF file, once, into a Hugging Face style model directory Loom can load.

transformers dequantizes the GGUF into an fp32 model; we write its config, state dict
(safetensors), tokenizer and generation config into
``$LOOM_CACHE_DIR/gguf/<name>-<size>-<digest>-v<N>`` (``~/.cache/loom`` by default).

The key is the file's content, not its path or modification time: a reinstall or a new venv
(new mtime, new path, same bytes) finds the entry it converted before. ``<digest>`` is xxh3-64 of
the whole file up to ``FULL_HASH_MAX_BYTES`` (the 98 MB default model hashes in 10-15 ms here,
page cache warm), and of its header, 64 evenly spaced chunks and its tail above that, so that a
start never reads tens of GB. After a conversion, the other entries of the same model name (an
older file, an older key layout) are removed: each holds ~600 MB for the 135M default.

Beside them, ``gguf_blocks.safetensors`` keeps the file's own block-quantized bytes of every
weight matrix, under the Hugging Face name of the dense tensor, rows in that tensor's order
(transformers permutes the rows of q and k for Llama). A tensor is kept only when dequantizing
its blocks with gguf-py gives exactly the dense tensor: a quantizer plugin that computes with the
blocks (``gguf``) multiplies the very weights transformers would. The
safetensors metadata ``types`` maps each name to its GGML type name (``Q4_1``...).

The directory appears atomically (built in a temp dir, then renamed) and a file lock per model
name makes concurrent processes (a test run and a server) convert only once, and never remove an
entry another one is writing.

A conversion reports itself (:mod:`loom.startup_progress`): what it does and how long it usually
takes, then a line every few seconds with its phase and, in the phases that count them, the
tensors done; transformers' own progress bars are folded into those counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
import xxhash

from loom.startup_progress import ProgressReporter

from .transformers_progress import report_transformers_progress

log = structlog.get_logger(__name__)

CONVERTER_VERSION = 2  # bump when the directory layout changes, so stale caches are rebuilt
_REQUIRED = ("config.json", "model.safetensors", "tokenizer_config.json")
BLOCKS_FILE = "gguf_blocks.safetensors"  # the file's quantized blocks (see the module docstring)
# The default SmolLM2-135M file (98 MB) converted in 25-31 s on the 2-core development machine
# (28-34 s with the start-up around it): the figure a first start quotes.
USUAL_CONVERSION_S = 30


def cache_root() -> Path:
    base = os.environ.get("LOOM_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "loom"
    return root / "gguf"


# Files up to this size are hashed whole; larger ones by HEADER_BYTES, SAMPLE_CHUNKS chunks of
# SAMPLE_BYTES spread evenly over the rest, and the last SAMPLE_BYTES (see the module docstring).
FULL_HASH_MAX_BYTES = 1 << 30
HEADER_BYTES = 16 << 20  # a GGUF's metadata (tokenizer vocabulary, tensor table) comes first
SAMPLE_CHUNKS = 64
SAMPLE_BYTES = 1 << 20
_READ_BYTES = 8 << 20


def content_digest(gguf: Path, size: int) -> str:
    """xxh3-64 (hex) of ``gguf``'s bytes: all of them, or the samples above for a big file."""
    digest = xxhash.xxh3_64()
    with open(gguf, "rb") as handle:
        if size <= FULL_HASH_MAX_BYTES:
            while chunk := handle.read(_READ_BYTES):
                digest.update(chunk)
        else:
            digest.update(handle.read(HEADER_BYTES))
            stride = (size - HEADER_BYTES) // SAMPLE_CHUNKS
            for i in range(SAMPLE_CHUNKS):
                handle.seek(HEADER_BYTES + i * stride)
                digest.update(handle.read(SAMPLE_BYTES))
            handle.seek(size - SAMPLE_BYTES)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def cache_key(gguf: Path) -> str:
    """``<name>-<size>-<content digest>-v<converter>``: equal for equal bytes wherever the file lives."""
    size = gguf.stat().st_size
    return f"{gguf.stem}-{size}-{content_digest(gguf, size)}-v{CONVERTER_VERSION}"


def _entry_pattern(stem: str) -> re.Pattern[str]:
    """Names of the entries of the model ``stem``, in this layout and the mtime-keyed one before it
    (``<name>-<size>-<mtime_ns>-v<N>``). Size, digest and version hold no ``-``, so another model
    whose name merely starts with ``stem`` never matches."""
    return re.compile(rf"{re.escape(stem)}-\d+-[0-9a-f]+-v\d+")


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)


@contextlib.contextmanager
def _file_lock(path: Path, **log_fields: Any) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting this model; waiting for it", lock=str(path), **log_fields)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _state_dict_for_saving(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage: drop the tied head, clone any other alias."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        ptr = tensor.untyped_storage().data_ptr()
        tensors[name] = (tensor.clone() if ptr in seen else tensor).detach().contiguous()
        seen.add(ptr)
    return tensors


def _convert(gguf: Path, out: Path, key: str, progress: ProgressReporter) -> None:
    progress.phase("importing transformers")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    # Most of from_pretrained is spent before its tensor loop: parsing the file's metadata and
    # mapping tensor names. Its loops (dequantizing, loading weights) count as phases of their own.
    progress.phase("reading the GGUF file")
    with report_transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights we write are dequantized
        del config.quantization_config
    config.architectures = [type(model).__name__]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # save_pretrained refuses GGUF-loaded models, so the pieces are written one by one.
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = _state_dict_for_saving(model, tied)
    progress.phase("writing model.safetensors")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_blocks(gguf, out / BLOCKS_FILE, state, config, progress)
    del model, state
    progress.phase("converting the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = int(config.max_position_embeddings)  # GGUF leaves it "unbounded"
    tokenizer.save_pretrained(out)
    source = {"gguf": str(gguf), "key": key, "size": gguf.stat().st_size, "converter": CONVERTER_VERSION}
    (out / "loom_gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _rows_after_reverse_permute(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a GGUF q/k matrix (it undoes llama.cpp's RoPE layout):
    result row i is file row order[i]."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def _matching_rows(values: np.ndarray, dense: np.ndarray, head_counts: set[int]) -> np.ndarray | None:
    """The order of the file's rows that makes them exactly ``dense``, or None."""
    rows = values.shape[0]
    candidates = [np.arange(rows)]
    candidates += [_rows_after_reverse_permute(rows, h) for h in sorted(head_counts) if h and rows % (2 * h) == 0]
    for order in candidates:
        if np.array_equal(values[order], dense):
            return order
    return None


def _write_blocks(gguf_path: Path, dest: Path, state: dict[str, torch.Tensor], config: object,
                  progress: ProgressReporter) -> None:
    """Write the file's block-quantized bytes of each 2-D weight that dequantizes to ``state``."""
    import gguf
    from safetensors.torch import save_file

    progress.phase("reading the GGUF blocks")
    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("general.architecture")
    arch_name = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        log.info("GGUF blocks not kept: unknown architecture", architecture=arch_name)
        return
    names = gguf.get_tensor_name_map(arch, int(getattr(config, "num_hidden_layers", 0)))
    by_name = {t.name: t for t in reader.tensors}
    heads = {int(getattr(config, "num_attention_heads", 0) or 0), int(getattr(config, "num_key_value_heads", 0) or 0)}
    dense_types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    blocks: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for hf_name, dense in progress.track(list(state.items()), "keeping the GGUF blocks"):
        tensor = by_name.get(names.get_name(hf_name, try_suffixes=(".weight",)) or "")
        if dense.dim() != 2 or tensor is None or tensor.tensor_type in dense_types:
            continue
        raw = np.asarray(tensor.data)  # [rows, bytes per row]
        values = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(dense.shape[0], -1)
        order = _matching_rows(values, dense.float().numpy(), heads)
        if order is None:
            log.warning("GGUF blocks not kept: they do not dequantize to the loaded tensor", tensor=hf_name)
            continue
        blocks[hf_name] = torch.from_numpy(np.ascontiguousarray(raw[order]))
        types[hf_name] = tensor.tensor_type.name
    if blocks:
        save_file(blocks, str(dest), metadata={"types": json.dumps(types)})


def _make_shareable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; the cache is meant to be shared.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _remove_stale_entries(root: Path, stem: str, keep: str) -> None:
    """Remove the other entries of model ``stem`` (an older file's, an older layout's).

    Call with the model's lock held. Each is renamed away first, so no process can find a
    half-removed directory under an entry's name."""
    pattern = _entry_pattern(stem)
    for entry in sorted(root.iterdir()):
        if entry.name == keep or not entry.is_dir() or not pattern.fullmatch(entry.name):
            continue
        try:
            size = _tree_bytes(entry)
            doomed = root / f".{entry.name}.stale-{os.getpid()}"
            os.rename(entry, doomed)
            shutil.rmtree(doomed)
        except OSError as exc:  # e.g. removed by someone else meanwhile, or not ours to remove
            log.warning("stale converted model not removed", path=str(entry), error=repr(exc))
            continue
        log.info("stale converted model removed (same model name, other content or layout)",
                 path=str(entry), bytes=size, kept=keep)


def converted_gguf_dir(gguf: Path) -> Path:
    """The cached HF-style directory for ``gguf``, converting it on first use."""
    gguf = gguf.resolve()
    root = cache_root()
    key = cache_key(gguf)
    final = root / key
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    # One lock per model name: conversions of it (any content) and the removal of its stale
    # entries never overlap.
    with _file_lock(root / f".{gguf.stem}.lock", gguf=str(gguf)):
        if _complete(final):  # another process finished while we waited
            return final
        if final.exists():  # damaged by hand: rebuild it
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            with ProgressReporter("converting the GGUF file into the cache, once per file", USUAL_CONVERSION_S,
                                  gguf=str(gguf), cache_dir=str(final)) as progress:
                _convert(gguf, tmp, key, progress)
            _make_shareable(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _complete(final):  # else: lost a race with a process that could not lock
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
        _remove_stale_entries(root, gguf.stem, keep=final.name)
    return final
