"""setup.py's default CUDA arch list, without building: its arch functions are taken from
the file (setup.py runs setup() when imported) and run against the installed torch."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

SETUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")
FUNCTIONS = ("_torch_build_archs", "_nvcc_archs", "_default_arch_list")


def arch_functions(cuda_home):
    tree = ast.parse(open(SETUP).read())
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS]
    assert {d.name for d in defs} == set(FUNCTIONS), "setup.py's arch functions were renamed"
    namespace = {"os": os, "subprocess": subprocess, "sys": sys, "torch": torch, "CUDA_HOME": cuda_home}
    exec(compile(ast.Module(body=defs, type_ignores=[]), SETUP, "exec"), namespace)
    return namespace


def torch_archs():
    flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, "_cuda_getArchFlags") else None
    return [a for a in (flags or "").split() if a.startswith("sm_")]


def unset_arch_list(monkeypatch):
    """Deletes TORCH_CUDA_ARCH_LIST such that monkeypatch restores its first state after the
    test (delenv of an absent variable records nothing, and setup.py's code sets it)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "placeholder")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")


def as_entry(sm):
    digits = sm[3:].rstrip("af")
    return f"{digits[:-1]}.{digits[-1]}{sm[3 + len(digits):]}"


@pytest.mark.skipif(not torch_archs(), reason="this torch has no CUDA archs (a CPU build)")
def test_default_arch_list_without_gpu_is_torchs_own_with_ptx(monkeypatch):
    fns = arch_functions(cuda_home="/nonexistent")  # no nvcc: no filtering by it
    unset_arch_list(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fns["_default_arch_list"]()
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].split()
    expected = sorted({as_entry(a) for a in torch_archs()}, key=lambda e: tuple(int(x) for x in e.rstrip("af").split(".")))
    assert archs[:-1] == expected[:-1] and archs[-1] == expected[-1] + "+PTX", (archs, expected)


def test_given_arch_list_is_kept(monkeypatch):
    fns = arch_functions(cuda_home="/nonexistent")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fns["_default_arch_list"]()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_archs_nvcc_cannot_build_are_dropped(monkeypatch):
    fns = arch_functions(cuda_home="/nonexistent")
    unset_arch_list(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(fns, "_torch_build_archs", lambda: ["5.0", "8.0", "9.0"])
    monkeypatch.setitem(fns, "_nvcc_archs", lambda: {"7.5", "8.0", "9.0", "10.0"})
    fns["_default_arch_list"]()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0+PTX"
