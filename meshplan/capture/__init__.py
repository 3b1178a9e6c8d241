"""capture pass."""
