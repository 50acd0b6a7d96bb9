"""NumPy models of each algorithm, float64, following the kernels' loop order and block names."""
