"""The CPU dropout's vectorized Philox (csrc/cpu/philox_lanes.h) against the scalar
philox::draws, and RowMultipliers::fill against the mask rule, element by element:
tests/philox_lanes_check.cpp compiled with the SIMD flags of fusednorm's own build (the
AVX2 lanes in an AVX2 or AVX-512 build, the scalar loop otherwise). Counters whose low word
wraps inside a register, many seeds and offsets, every count of quads up to 40, and rows of
1 .. 1027 columns filled in pieces of 1 .. 256 columns.

Skipped only without a C++ compiler (with FUSEDNORM_REQUIRE_EMULATION=1, set by CI, that is
a failure instead).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import torch.utils.cpp_extension

import fusednorm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vectorized_draws_equal_the_scalar_function(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        if os.environ.get("FUSEDNORM_REQUIRE_EMULATION") == "1":
            pytest.fail("FUSEDNORM_REQUIRE_EMULATION=1 but no C++ compiler (g++) was found")
        pytest.skip("no C++ compiler (g++) to build the check")
    from fusednorm import _build_config

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [os.path.join(REPO, "csrc")] + torch.utils.cpp_extension.include_paths()[:1]
    binary = str(tmp_path / "philox_lanes_check")
    cmd = [compiler, "-std=c++20", "-O2", "-ffp-contract=off", *_build_config.CPU_SIMD_FLAGS,
           *(f"-I{d}" for d in includes), os.path.join(REPO, "tests", "philox_lanes_check.cpp"),
           "-o", binary, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"check build failed:\n{' '.join(cmd)}\n{built.stderr[-6000:]}"
    done = subprocess.run([binary], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(" 0 mismatches"), done.stdout
    # The path the build's kernels run was the one checked.
    lanes = fusednorm.build_info()["cpu_capability"] in ("avx2", "avx512")
    assert done.stdout.startswith("AVX2 lanes" if lanes else "scalar"), done.stdout
