"""From ``--model-id`` to a local Hugging Face style directory, and facts read from it."""

from __future__ import annotations

import json
from pathlib import Path

from .default_model import default_gguf
from .errors import ModelLoadError
from .gguf_cache import converted_gguf_dir
from .random_model import is_random_model_id, random_model_dir, random_shape


def check_model_id(model_id: str | None) -> None:
    """Raise ModelLoadError if ``model_id`` cannot name a model, without converting or writing
    anything (a start-up check before the model loads)."""
    if model_id is None:
        default_gguf()  # the bundled package must be installed
    elif is_random_model_id(model_id):
        random_shape(model_id)
    else:
        _local_model(model_id)


def _local_model(model_id: str) -> tuple[Path, bool]:
    """(the path, whether it is a GGUF file to convert); ModelLoadError when it is neither."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, False
        raise ModelLoadError(f"--model-id {model_id!r} is a directory without config.json; point it at "
                             "a Hugging Face model directory or a .gguf file")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path, True
    if path.is_file():
        raise ModelLoadError(f"--model-id {model_id!r} is a file but not a .gguf; give a .gguf file or a "
                             "Hugging Face model directory")
    raise ModelLoadError(f"--model-id {model_id!r} does not exist; Loom serves local models only: a Hugging "
                         "Face model directory (with config.json) or a .gguf file")


def resolve_model_dir(model_id: str | None) -> Path:
    """None: the bundled SmolLM2 GGUF; a directory with config.json; a .gguf file; or ``random:NAME``.

    GGUF files are converted once into the cache (see :mod:`loom.model_loader.gguf_cache`).
    Loom never downloads: anything else is an error.
    """
    if model_id is None:
        return converted_gguf_dir(default_gguf())
    if is_random_model_id(model_id):  # random:NAME, a benchmark shape without weights
        return random_model_dir(model_id)
    path, is_gguf = _local_model(model_id)
    return converted_gguf_dir(path) if is_gguf else path


def _eos_ids_in(path: Path) -> tuple[int, ...]:
    if not path.is_file():
        return ()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(i) for i in ids))  # dedupe, keep order


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """All EOS ids: generation_config.json's (int or list) first, config.json's as a fallback."""
    return _eos_ids_in(model_dir / "generation_config.json") or _eos_ids_in(model_dir / "config.json")
