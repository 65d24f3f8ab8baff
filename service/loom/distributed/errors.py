"""Errors of the tensor-parallel ranks (no torch import: the front end reads them too)."""


class ShardLostError(RuntimeError):
    """A tensor-parallel rank died or hung: the engine cannot step any more."""
