"""Stubs generated from the ``loom.v1`` protos by ``scripts/gen_protos.py``: never edit them by hand.

Import them as ``from loom_client.v1 import generation_pb2, generation_pb2_grpc``.
"""
