"""Converting a GGUF file, once, into a Hugging Face style model directory Loom can load.

transformers dequantizes the GGUF into an fp32 model; we write its config, state dict
(safetensors), tokenizer and generation config into
``$LOOM_CACHE_DIR/gguf/<name>-<size>-<mtime>-v<N>`` (``~/.cache/loom`` by default). The
directory appears atomically (built in a temp dir, then renamed) and a file lock makes
concurrent processes (a test run and a server) convert only once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

CONVERTER_VERSION = 1  # bump when the directory layout changes, so stale caches are rebuilt
_REQUIRED = ("config.json", "model.safetensors", "tokenizer_config.json")


def cache_root() -> Path:
    base = os.environ.get("LOOM_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "loom"
    return root / "gguf"


def cache_key(gguf: Path) -> str:
    st = gguf.stat()
    return f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-v{CONVERTER_VERSION}"


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a+") as handle:
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


def _convert(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights we write are dequantized
        del config.quantization_config
    config.architectures = [type(model).__name__]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # save_pretrained refuses GGUF-loaded models, so the pieces are written one by one.
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_file(_state_dict_for_saving(model, tied), str(out / "model.safetensors"), metadata={"format": "pt"})
    del model
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = int(config.max_position_embeddings)  # GGUF leaves it "unbounded"
    tokenizer.save_pretrained(out)
    st = gguf.stat()
    source = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "converter": CONVERTER_VERSION}
    (out / "loom_gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _make_shareable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only files; the cache is meant to be shared.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def converted_gguf_dir(gguf: Path) -> Path:
    """The cached HF-style directory for ``gguf``, converting it on first use (~20 s for 135M)."""
    gguf = gguf.resolve()
    root = cache_root()
    final = root / cache_key(gguf)
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if _complete(final):  # another process finished while we waited
            return final
        if final.exists():  # damaged by hand: rebuild it
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            _convert(gguf, tmp)
            _make_shareable(tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _complete(final):  # else: lost a race with a process that could not lock
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return final
