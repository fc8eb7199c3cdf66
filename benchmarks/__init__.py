"""fusednorm's benchmark suites (`python -m benchmarks`); results land in benchmarks/results/.

Importing the package (before torch) asks PyTorch's CPU allocator for 2 MiB pages
(THP_MEM_ALLOC_ENABLE=1, PyTorch's own setting; an explicit value in the environment
wins): an output above glibc's mmap threshold (32 MiB) is otherwise fresh memory on every
call, and its 4 KiB page faults, not the kernels, decide the CPU times at training sizes
(measured: 3x at 16384 x 2048 float32, for every provider, with results varying run to run
by where the heap happens to put them). benchmarks.harness.allocator_note says what applied.
"""
import os
import sys

THP_SETTING = "THP_MEM_ALLOC_ENABLE"
THP_SET_BEFORE_TORCH = "torch" not in sys.modules
os.environ.setdefault(THP_SETTING, "1")
