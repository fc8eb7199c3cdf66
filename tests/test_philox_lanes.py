"""The CPU dropout's vectorized Philox (csrc/cpu/philox_lanes.h) against the scalar
philox::draws, and RowMultipliers::fill against the mask rule, element by element:
tests/philox_lanes_check.cpp compiled with setup.py's flags for each SIMD level this CPU
runs (AVX-512: 16 lanes, AVX2: 8 lanes, default: the scalar loop), the build's among them.
Counters whose low word wraps inside a register, many seeds and offsets, every count of
quads up to 40 and 1000, and rows of 1 .. 1027 columns filled in pieces of 1 .. 1024 columns
and whole.

Skipped only without a C++ compiler (with FUSEDNORM_REQUIRE_EMULATION=1, set by CI, that is
a failure instead).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.utils.cpp_extension

import fusednorm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = ["default", "avx2", "avx512"]  # setup.py's FUSEDNORM_CPU_CAPABILITY values, in order
PATH = {"default": "scalar", "avx2": "8 lanes", "avx512": "16 lanes"}


def cpu_flags(level):
    """setup.py's _cpu_flags(level), taken from the file (importing it runs setup())."""
    setup = os.path.join(REPO, "setup.py")
    tree = ast.parse(open(setup).read())
    defs = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "_cpu_flags"]
    assert defs, "setup.py's _cpu_flags was renamed"
    namespace = {"sys": sys}
    exec(compile(ast.Module(body=defs, type_ignores=[]), setup, "exec"), namespace)
    return namespace["_cpu_flags"](level)


def runnable_levels():
    have = torch.backends.cpu.get_cpu_capability().lower()
    top = "avx512" if have.startswith("avx512") else have if have in LEVELS else "default"
    return LEVELS[:LEVELS.index(top) + 1]


def test_the_builds_level_is_checked():
    assert fusednorm.build_info()["cpu_capability"] in runnable_levels()


@pytest.mark.parametrize("level", LEVELS)
def test_vectorized_draws_equal_the_scalar_function(level, tmp_path):
    if level not in runnable_levels():
        pytest.skip(f"this CPU does not run {level} code")
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        if os.environ.get("FUSEDNORM_REQUIRE_EMULATION") == "1":
            pytest.fail("FUSEDNORM_REQUIRE_EMULATION=1 but no C++ compiler (g++) was found")
        pytest.skip("no C++ compiler (g++) to build the check")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [os.path.join(REPO, "csrc")] + torch.utils.cpp_extension.include_paths()[:1]
    binary = str(tmp_path / "philox_lanes_check")
    cmd = [compiler, "-std=c++20", "-O2", "-ffp-contract=off", *cpu_flags(level),
           *(f"-I{d}" for d in includes), os.path.join(REPO, "tests", "philox_lanes_check.cpp"),
           "-o", binary, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"check build failed:\n{' '.join(cmd)}\n{built.stderr[-6000:]}"
    done = subprocess.run([binary], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(PATH[level] + ":"), done.stdout  # the level's own path
    assert done.stdout.strip().endswith(" 0 mismatches"), done.stdout
