"""intra pass."""
