"""User-facing outputs: charts and reports people look at (DESIGN.md §7)."""
