"""Whether fusednorm (and peers) can really run a suite here. A fusednorm without compiled
kernels for the device would silently run its plain-PyTorch reference: benchmarking that
under fusednorm's name would be wrong, so such a provider is skipped with the reason."""
from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Callable

import torch

_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def _registered_ops(device: torch.device) -> list[str]:
    key = _DISPATCH_KEY.get(device.type)
    if key is None:
        return []
    return [n for n in torch._C._dispatch_get_registrations_for_dispatch_key(key)
            if n.startswith("fusednorm::")]


def import_fusednorm():
    """The fusednorm module, or None when it does not import (fusednorm_skip_reason says
    why, per provider)."""
    try:
        import fusednorm
    except ImportError:
        return None
    return fusednorm


def fusednorm_skip_reason(device: torch.device, op_prefix: str, api: str) -> str | None:
    """None when fusednorm.<api> exists and ops fusednorm::<op_prefix>* have compiled
    kernels for the device; otherwise why the fusednorm provider cannot be benchmarked."""
    try:
        import fusednorm
    except ImportError as error:
        return f"fusednorm is not importable: {error}"
    where = Path(fusednorm.__file__).parent
    if not hasattr(fusednorm, api):
        return f"fusednorm.{api} does not exist in this build (imported from {where})"
    if any(n.startswith(f"fusednorm::{op_prefix}") for n in _registered_ops(device)):
        return None
    info = fusednorm.build_info()
    why = info.get("load_error") or f"no compiled {device.type} kernel for fusednorm::{op_prefix}*"
    hint = ""
    if info.get("load_error") and "not compiled" in info["load_error"]:
        hint = (" (the source tree shadows the installed package when run from the repository"
                " root: build it in place with `bash scripts/install.sh`, or"
                " `python setup.py build_ext --inplace` then"
                " `FUSEDNORM_SKIP_BUILD_EXT=1 pip install --no-build-isolation -e .`)")
    return f"fusednorm imported from {where} cannot run on {device.type}: {why}{hint}"


# The peers a GPU run of a suite times beside fusednorm where the suite has them (its
# provider name: the module to import, how to install it). A run without one skips it and
# says so; --save on a GPU refuses (cli.peer_refusal): published files keep its column.
GPU_PEERS = {"liger": ("liger_kernel", "pip install liger-kernel")}


def not_importable(peer: str) -> str:
    """A GPU peer's absence, with how to install it."""
    module, install = GPU_PEERS[peer]
    return f"{module} is not importable ({install})"


def call_skip_reason(call: Callable[[], object], what: str) -> str | None:
    """None when call() runs (a tiny forward and backward of a provider's options); else
    why `what` cannot be benchmarked here, e.g. a fusednorm that predates a keyword argument
    or has no kernel for it on the device."""
    try:
        call()
    except Exception as error:  # TypeError, NotImplementedError, a RuntimeError of a check
        first_line = (str(error).splitlines() or [""])[0]
        return f"{what} raised {type(error).__name__}: {first_line}"
    return None


def usable_providers(wanted, known, device: torch.device, notes: list[str], *, backend_op: str,
                     api: str, liger=None) -> list[str]:
    """wanted minus those that cannot run here, each absence explained in notes: fusednorm
    (and its variants, named "fusednorm <variant>") without a kernel of
    fusednorm::<backend_op> for the device or without fusednorm.<api>;
    liger off a GPU or where liger() (a liger_* function below) finds no Liger-Kernel.
    known: every provider name of the suite."""
    usable = []
    for name in wanted:
        if name not in known:
            raise SystemExit(f"unknown provider {name!r}; choose among {list(known)}")
        reason = None
        if name == "fusednorm" or name.startswith("fusednorm "):
            reason = fusednorm_skip_reason(device, backend_op, api)
        elif name == "liger":
            if device.type != "cuda":
                reason = "Liger-Kernel runs on GPUs only"
            elif liger is None or liger() is None:
                reason = not_importable(name)
        if reason is None:
            usable.append(name)
        else:
            notes.append(f"{name} not benchmarked: {reason}")
    return usable


def _liger_function(module: str, name: str):
    """liger_kernel.ops.<module>.<name>, or None when Liger is not importable."""
    try:
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)
    except Exception:  # ImportError, AttributeError, or a Triton/driver error at import
        return None


@functools.cache
def liger_layer_norm():
    """Liger-Kernel's LigerLayerNormFunction, or None when Liger is not importable."""
    return _liger_function("layer_norm", "LigerLayerNormFunction")


@functools.cache
def liger_rms_norm():
    """Liger-Kernel's LigerRMSNormFunction, or None when Liger is not importable."""
    return _liger_function("rms_norm", "LigerRMSNormFunction")


@functools.cache
def liger_fused_add_rms_norm():
    """Liger-Kernel's LigerFusedAddRMSNormFunction (add + RMSNorm), or None when Liger is
    not importable."""
    return _liger_function("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
