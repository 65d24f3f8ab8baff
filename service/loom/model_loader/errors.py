"""The error model loading raises for problems a user can act on."""

from __future__ import annotations

from loom.config import ConfigError


class ModelLoadError(ConfigError):
    """A model id, file or checkpoint Loom cannot serve; the message says what to change."""
