"""ir pass."""
