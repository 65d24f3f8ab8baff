"""Loom: a gRPC-first LLM inference server."""

__version__ = "0.1.0"
