"""meshplan: automatic parallelization of PyTorch training (Alpa + HAP)."""
