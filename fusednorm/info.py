"""build_info(): what this installation of fusednorm compiled and can run."""
from __future__ import annotations

import torch

from . import _loader

__version__ = "0.1.0"


def build_info() -> dict:
    """Compiled kernels and the versions around them, e.g. for bug reports and results
    files: {'fusednorm', 'torch', 'cuda', 'compiled', 'cpu_capability', 'cpu_ffn_gemm',
    'cpu_kernels', 'cuda_kernels', 'cuda_archs', 'load_error', 'fast_calls',
    'fast_calls_error'}: cpu_ffn_gemm is the library that runs the CPU FFN's large float32
    GEMMs here by default ('onednn' or 'aten', see FUSEDNORM_CPU_GEMM in the README);
    fast_calls is whether the functions call the ops through fusednorm._fast (else torch.ops)."""
    compiled: dict[str, str] = {}
    if _loader.AVAILABLE:
        for line in torch.ops.fusednorm.build_info().splitlines():
            key, _, value = line.partition("=")
            compiled[key] = value
    return {
        "fusednorm": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "compiled": _loader.AVAILABLE,
        "cpu_capability": compiled.get("cpu_capability"),
        "cpu_ffn_gemm": compiled.get("cpu_ffn_gemm"),
        "cpu_kernels": _loader.has_kernel("norm_fwd", "cpu"),
        "cuda_kernels": _loader.has_kernel("norm_fwd", "cuda"),
        "cuda_archs": compiled.get("cuda_archs", "").replace("_", " ").split(),
        "load_error": _loader.LOAD_ERROR,
        "fast_calls": _loader.FAST_CALLS is not None,
        "fast_calls_error": _loader.FAST_CALLS_ERROR,
    }
