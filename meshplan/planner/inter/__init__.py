"""inter pass: layers, stages on submeshes, micro-batches (Alpa §5)."""
