"""Which tensor-parallel rank this process is, and the collectives between ranks."""
