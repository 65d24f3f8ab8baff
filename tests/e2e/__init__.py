"""End-to-end tests: the real server process over gRPC."""
