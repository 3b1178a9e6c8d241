"""runtime pass."""
