"""The gRPC server: validation, the GenerationService, health, reflection, start-up and drain."""
