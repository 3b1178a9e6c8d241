"""plan pass."""
