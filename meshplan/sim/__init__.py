"""The simulator: a plan's step on a virtual clock (DESIGN.md §7)."""
