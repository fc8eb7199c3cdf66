"""Same-process A/B of the CPU norm kernels of two source trees: see __main__.py."""
