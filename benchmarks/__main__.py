"""`python -m benchmarks`: run every suite on this machine's device and print the tables."""
from .run_all import main

if __name__ == "__main__":
    main()
