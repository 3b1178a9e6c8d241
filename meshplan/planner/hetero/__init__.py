"""hetero pass: per-device shard ratios and program synthesis on mixed clusters (HAP)."""
