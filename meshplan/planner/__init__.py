"""planner pass."""
