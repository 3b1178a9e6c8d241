"""cost pass."""
