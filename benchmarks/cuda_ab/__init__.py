"""CUDA A/B: variants of the norm-family kernels compiled side by side and timed in turns."""
