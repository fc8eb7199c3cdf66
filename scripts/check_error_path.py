"""Exits 0 when the compiled library turns a rejected argument into a Python exception.

Run as its own process after a build: a library whose C++ error path is broken crashes
here (the exit status is then the signal's) instead of in the first user program that
passes a bad argument. Seen on a GPU machine whose default C++ compiler was /opt/gcc:
formatting the first error message (c10::str of a shape) segfaulted, for every op, CPU
tensors included, in libstdc++ code that the debugger placed inside the library itself.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

# The checkout's fusednorm, also before `pip install -e` has registered it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fusednorm  # noqa: E402

info = fusednorm.build_info()
if not info["compiled"]:
    sys.exit(f"fusednorm's compiled library did not load: {info['load_error']}")
try:
    torch.ops.fusednorm.norm_fwd(torch.randn(2, 3, 4), None, None, None, 1e-5, True)
except RuntimeError as error:
    if "2-D" not in str(error):
        sys.exit(f"unexpected error message from a rejected argument: {error}")
else:
    sys.exit("norm_fwd accepted a 3-D input it must reject")
print("error path ok: a rejected argument raised RuntimeError")
