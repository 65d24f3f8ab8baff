"""Shared test helpers (importable as ``helpers`` once tests/conftest.py has run)."""
