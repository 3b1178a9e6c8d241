"""lower pass."""
