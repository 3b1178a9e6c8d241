"""zoo pass."""
