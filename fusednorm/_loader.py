"""Loads the compiled library fusednorm._C, whose import registers torch.ops.fusednorm.*.

The CPU kernels are compiled for the SIMD level of the building machine; on a CPU without
it the library is not loaded (it would die of an illegal instruction) and fusednorm falls
back to its plain-PyTorch reference with a warning.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from pathlib import Path

import torch

# torch.backends.cpu.get_cpu_capability() names, lowest first.
_CAPABILITY_ORDER = ["default", "avx2", "avx512"]

LOAD_ERROR: str | None = None


def _cpu_supports(built: str) -> bool:
    have = torch.backends.cpu.get_cpu_capability().lower()
    if have.startswith("avx512"):
        have = "avx512"
    if built == "default" or have not in _CAPABILITY_ORDER:
        return built == "default"
    return _CAPABILITY_ORDER.index(have) >= _CAPABILITY_ORDER.index(built)


# How to build (or rebuild) the library: docs/install.md, README.
REBUILD = ("rebuild it: `bash scripts/install.sh` in a checkout, or "
           "`pip install --no-build-isolation .` (docs/install.md)")


def _library_present() -> bool:
    """Whether the compiled library's file (fusednorm/_C.*) is there."""
    return any(Path(__file__).resolve().parent.glob("_C.*"))


def _load() -> bool:
    """Loads _C when the build record allows it; else sets LOAD_ERROR (what is wrong, ending
    with how to rebuild) and returns False. Checked before the import: a library built
    against another torch may fail to load with an undefined symbol, or load and crash."""
    global LOAD_ERROR
    try:
        _build_config = importlib.import_module(f"{__package__}._build_config")
    except ImportError:
        LOAD_ERROR = f"fusednorm was not compiled (no fusednorm/_build_config.py); {REBUILD}"
        return False
    if not _library_present():
        LOAD_ERROR = ("fusednorm's compiled library fusednorm/_C.* is missing (the build "
                      f"failed, or its file was removed); {REBUILD}")
        return False
    built_with = getattr(_build_config, "BUILT_WITH_TORCH", None)
    if built_with is not None and built_with != str(torch.__version__):
        LOAD_ERROR = (f"fusednorm._C was built against torch {built_with}, but torch "
                      f"{torch.__version__} is installed; {REBUILD}")
        return False
    if not _cpu_supports(_build_config.CPU_CAPABILITY):
        LOAD_ERROR = (
            f"fusednorm._C was built for {_build_config.CPU_CAPABILITY} but this CPU supports "
            f"{torch.backends.cpu.get_cpu_capability()}; rebuild with "
            "FUSEDNORM_CPU_CAPABILITY=default"
        )
        return False
    try:
        from . import _C  # noqa: F401  (registers the ops)
    except ImportError as error:
        LOAD_ERROR = f"fusednorm._C failed to import ({error}); {REBUILD}"
        return False
    return True


AVAILABLE = _load()
if not AVAILABLE:
    warnings.warn(
        f"fusednorm runs its plain-PyTorch reference instead of its kernels (slow): {LOAD_ERROR}",
        RuntimeWarning,
        stacklevel=2,
    )


def compile_cache_tag(build_stamp: str) -> str:
    """fusednorm's part of torch.compile's cache key tag, from a stamp of the loaded build."""
    return "fusednorm-" + hashlib.sha256(build_stamp.encode()).hexdigest()[:16]


def _build_stamp() -> str:
    """The loaded build's stamp: the hash of the sources it was compiled from (csrc/, where
    every op's schema is written; setup.py records it), else the library file's size and
    modification time."""
    from . import _build_config, _C

    source_hash = getattr(_build_config, "SOURCE_HASH", None)
    if source_hash:
        return source_hash
    stat = os.stat(_C.__file__)
    return f"{stat.st_size:x}{stat.st_mtime_ns:x}"


def _tag_compile_caches() -> None:
    """torch.compile's caches on disk (Inductor's FX graph cache, AOTAutograd's, under
    /tmp/torchinductor_<user>) know a custom op in a graph by its name only, not by its
    schema or kernels: an entry compiled against another build of fusednorm (an op since
    changed or removed) would be loaded. Their documented cache breaker,
    torch.compiler.config.cache_key_tag, gets this build's tag appended (a tag the user set
    before the import is kept)."""
    config = getattr(torch.compiler, "config", None)
    if not hasattr(config, "cache_key_tag"):
        return
    ours = compile_cache_tag(_build_stamp())
    tag = config.cache_key_tag
    if ours not in tag.split(","):
        config.cache_key_tag = f"{tag},{ours}" if tag else ours


if AVAILABLE:
    _tag_compile_caches()


def _load_fast_calls():
    """fusednorm._fast (csrc/python/fast_calls.cpp), the direct Python entries into the ops
    that fusednorm.functional calls first; None without _C, when FUSEDNORM_FAST_CALLS=0, or
    when it did not build or import (then every call goes through torch.ops, only slower)."""
    global FAST_CALLS_ERROR
    if not AVAILABLE:
        FAST_CALLS_ERROR = "fusednorm._C is not loaded"
        return None
    if os.environ.get("FUSEDNORM_FAST_CALLS", "1") == "0":
        FAST_CALLS_ERROR = "FUSEDNORM_FAST_CALLS=0"
        return None
    try:
        from . import _fast
    except ImportError as error:
        FAST_CALLS_ERROR = f"fusednorm._fast failed to import: {error}"
        return None
    return _fast


FAST_CALLS_ERROR: str | None = None
FAST_CALLS = _load_fast_calls()


def _compiled_kernels() -> frozenset[tuple[str, str]]:
    """(op name, device type) for every fusednorm op kernel in the loaded library."""
    if not AVAILABLE:
        return frozenset()
    ops = [
        name.split("::", 1)[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("fusednorm::")
    ]
    return frozenset(
        (op, device)
        for op in ops
        for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"fusednorm::{op}", key)
    )


# Computed once: a set lookup is also what torch.compile can trace without a graph break.
KERNELS = _compiled_kernels()


def _public_ops() -> tuple[str, ...]:
    """The public ops of csrc/op_table.h, as the library reports them (empty without it)."""
    if not AVAILABLE:
        return ()
    for line in torch.ops.fusednorm.build_info().splitlines():
        key, _, value = line.partition("=")
        if key == "public_ops":
            return tuple(name for name in value.split(",") if name)
    return ()


PUBLIC_OPS = _public_ops()


def has_kernel(op: str, device_type: str) -> bool:
    """Whether torch.ops.fusednorm.<op> has a compiled kernel for this device type."""
    return (op, device_type) in KERNELS
