"""Speculative decoding, the engine core's side: which sequences get drafts, and what happens to
them (the proposers are plugins, ``loom.plugin_api.speculative``; verification is
``loom.sample.verify``)."""
