"""Loom's built-in plugins, registered through the ``loom`` entry-point group like any other."""
