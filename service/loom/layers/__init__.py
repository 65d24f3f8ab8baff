"""Building blocks shared by model plugins: attention, rotary embeddings, norms, activations."""
