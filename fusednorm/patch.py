"""Swapping fusednorm's modules into an existing model.

SWAPS lists every norm class that fusednorm can stand in for with the same results, keyed by
the class's full name (so that timm, transformers, ... need not be imported to look it up).
Each entry was checked by reading the class's forward: it must compute exactly what the
target's forward computes over the same attributes. transformers' and timm's entries come
from scripts/norm_survey.py, which keeps the verdict for every norm class of those
libraries (docs/models.md); supporting another class is a verdict there. Such a class is
swapped only while its live code has the fingerprint recorded for it (another version's
class of the same name may compute differently).
"""
from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from torch import nn
from torch.nn.utils import parametrize

from . import swap_targets
from ._fingerprint import fingerprint, methods_from_source
from .errors import FusedTypeError
from .layer_norm_2d import FusedLayerNorm2d
from .library_classes import SWAPPED, VERSIONS
from .modules import FusedHFRMSNorm, FusedLayerNorm, FusedRMSNorm

logger = logging.getLogger("fusednorm")


def _timm_fast_norm(module: nn.Module) -> Optional[str]:
    # timm.layers.set_fast_norm(True) routes these through apex or a low-precision autocast
    # path, which F.layer_norm (and fusednorm) do not follow.
    if getattr(module, "_fast_norm", False):
        return "timm's fast norm is on (timm.layers.set_fast_norm): it computes differently"
    return None


@dataclass(frozen=True)
class Swap:
    """How one norm class becomes a fusednorm module: its class is replaced in place by
    `target` (parameters, buffers, hooks and attributes kept)."""

    family: str  # which replace_* function swaps it: "layer_norm" or "rms_norm"
    target: type
    # A reason to leave this particular instance alone (e.g. a mode that computes
    # differently), or None to swap it.
    keep_if: Callable[[nn.Module], Optional[str]] = lambda module: None
    # Renames or adds the attributes the target's forward reads (e.g. eps from
    # variance_epsilon), before the class changes.
    adapt: Optional[Callable[[nn.Module], None]] = None


def _grouped(module: nn.Module) -> Optional[str]:
    if getattr(module, "group_size", None) is not None:
        return f"it normalizes groups of group_size={module.group_size}, not the whole row"
    return None


def _per_head_weight(module: nn.Module) -> Optional[str]:
    if module.weight.dim() != 1:
        return (f"its weight has shape {tuple(module.weight.shape)} (per-head norms): it "
                "normalizes the last dim only")
    return None


# The fusednorm class for each verdict of scripts/norm_survey.py, with its family and rules.
TARGETS: dict[str, Swap] = {
    "FusedLayerNorm": Swap("layer_norm", FusedLayerNorm, keep_if=_timm_fast_norm),
    "FusedLayerNorm2d": Swap("layer_norm", FusedLayerNorm2d, keep_if=_timm_fast_norm),
    "FusedLayerNormFp32": Swap("layer_norm", swap_targets.FusedLayerNormFp32),
    "FusedLayerNorm2dFp32": Swap("layer_norm", swap_targets.FusedLayerNorm2dFp32),
    "FusedLayerNormChannelsFirst": Swap("layer_norm", swap_targets.FusedLayerNormChannelsFirst),
    "FusedDataFormatLayerNorm": Swap("layer_norm", swap_targets.FusedDataFormatLayerNorm),
    "FusedHFLayerNorm": Swap("layer_norm", swap_targets.FusedHFLayerNorm),
    "FusedHFLayerNormCastLast": Swap("layer_norm", swap_targets.FusedHFLayerNormCastLast,
                                     keep_if=_per_head_weight),
    "FusedParameterFreeLayerNorm": Swap("layer_norm", swap_targets.FusedParameterFreeLayerNorm),
    "FusedHFRMSNorm": Swap("rms_norm", FusedHFRMSNorm),
    "FusedHFRMSNormCastLast": Swap("rms_norm", swap_targets.FusedHFRMSNormCastLast),
    "FusedT5LayerNorm": Swap("rms_norm", swap_targets.FusedT5LayerNorm),
    "FusedGemmaRMSNorm": Swap("rms_norm", swap_targets.FusedGemmaRMSNorm, keep_if=_grouped),
    "FusedRMSNormFp32": Swap("rms_norm", swap_targets.FusedRMSNormFp32),
    "FusedRMSNorm2dFp32": Swap("rms_norm", swap_targets.FusedRMSNorm2dFp32),
    "FusedLayerNormAct": Swap("layer_norm", swap_targets.FusedLayerNormAct,
                              keep_if=_timm_fast_norm),
    "FusedLayerNormAct2d": Swap("layer_norm", swap_targets.FusedLayerNormAct2d,
                                keep_if=_timm_fast_norm),
    "FusedLayerNormActFp32": Swap("layer_norm", swap_targets.FusedLayerNormActFp32),
    "FusedLayerNormAct2dFp32": Swap("layer_norm", swap_targets.FusedLayerNormAct2dFp32),
    "FusedRMSNormActFp32": Swap("rms_norm", swap_targets.FusedRMSNormActFp32),
    "FusedRMSNormAct2dFp32": Swap("rms_norm", swap_targets.FusedRMSNormAct2dFp32),
}

SWAPS: dict[str, Swap] = {
    # torch: F.layer_norm(x, normalized_shape, weight, bias, eps).
    "torch.nn.modules.normalization.LayerNorm": Swap("layer_norm", FusedLayerNorm),
    # torch: F.rms_norm(x, normalized_shape, weight, eps).
    "torch.nn.modules.normalization.RMSNorm": Swap("rms_norm", FusedRMSNorm),
    # transformers' and timm's: surveyed by scripts/norm_survey.py (docs/models.md).
    **{name: TARGETS[target] for name, (target, _) in SWAPPED.items()},
}


def _code_differs(cls: type, name: str) -> Optional[str]:
    """Why a class of SWAPPED is kept: its live code is not the code that was judged."""
    library = name.split(".", 1)[0]
    judged = f"the {library} {VERSIONS[library]} class fusednorm checked"
    live = fingerprint(cls)
    if live is None:
        return (f"its source is unavailable (inspect.getsource) to compare with {judged}; "
                "not swapped")
    if live != SWAPPED[name][1] or not methods_from_source(cls):
        return f"its code differs from {judged}; not swapped"
    return None


def class_name(cls: type) -> str:
    """'module.QualName', the key of SWAPS."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class NormEntry:
    """One norm module of a model and what replace_layernorm does with it."""

    name: str  # its path in the model, as named_modules() gives it ("" for the model itself)
    cls: str  # its class, 'module.QualName'
    action: str  # "fused" (already fusednorm's), "swap" (replace_* swaps it) or "keep"
    detail: str  # swap: the target class; keep: why; fused: ""


@dataclass(frozen=True)
class NormReport:
    """The norm modules of a model: what fusednorm swaps, has swapped, and leaves alone."""

    entries: tuple[NormEntry, ...]

    def count(self, action: str) -> int:
        return sum(entry.action == action for entry in self.entries)

    def summary(self, action: str) -> str:
        """'25 timm.layers.norm.LayerNorm -> FusedLayerNorm, 1 ...' for one action."""
        groups = Counter((e.cls, e.detail) for e in self.entries if e.action == action)
        arrow = " -> " if action == "swap" else ": "
        return ", ".join(
            f"{n} {cls}" + (f"{arrow}{detail}" if detail else "")
            for (cls, detail), n in groups.items()
        )

    def __str__(self) -> str:
        lines = [f"{len(self.entries)} norm modules: {self.count('fused')} fusednorm, "
                 f"{self.count('swap')} to swap, {self.count('keep')} kept"]
        for action in ("fused", "swap", "keep"):
            if self.count(action):
                lines.append(f"  {action}: {self.summary(action)}")
        return "\n".join(lines)


_NORM_BASES = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
               nn.modules.batchnorm._NormBase) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer: a torch norm class or a leaf module whose class is named *Norm*
    (LlamaRMSNorm, T5LayerNorm, ...). Only for reporting: swaps go by SWAPS alone."""
    if isinstance(module, _NORM_BASES):
        return True
    return "norm" in type(module).__name__.lower() and next(module.children(), None) is None


def _plan(model: nn.Module, families: Optional[tuple[str, ...]]) -> NormReport:
    table = {k: s for k, s in SWAPS.items() if families is None or s.family in families}
    fused = tuple({s.target for s in SWAPS.values()})
    entries = []
    differs: dict[type, Optional[str]] = {}  # per class, once per plan
    for name, module in model.named_modules():
        # A parametrized module (torch.nn.utils.parametrize) is of a class made for it over
        # its own: swapped by that one.
        base = parametrize.type_before_parametrizations(module)
        cls = class_name(base)
        swap = table.get(cls)
        if isinstance(module, fused):
            entries.append(NormEntry(name, class_name(type(module)), "fused", ""))
        elif swap is not None:
            if cls in SWAPPED and base not in differs:
                differs[base] = _code_differs(base, cls)
            reason = differs.get(base) or swap.keep_if(module)
            entries.append(NormEntry(name, cls, "keep", reason) if reason
                           else NormEntry(name, cls, "swap", swap.target.__name__))
        elif _is_norm(module):
            entries.append(NormEntry(name, cls, "keep", _why_not(module, cls)))
    return NormReport(tuple(entries))


# The families each replace function swaps.
REPLACE_FAMILIES: dict[str, tuple[str, ...]] = {
    "replace_layernorm": ("layer_norm",),
    "replace_norms": ("layer_norm", "rms_norm"),
}


def _why_not(module: nn.Module, cls: str) -> str:
    if cls in SWAPS:
        family = SWAPS[cls].family
        by = [f"fusednorm.{name}" for name, families in REPLACE_FAMILIES.items()
              if family in families]
        return (f"swapped by {' or '.join(by)} ({family} family)" if by
                else f"swapped by another replace function ({family} family)")
    if isinstance(module, nn.LayerNorm):
        return "a subclass of nn.LayerNorm not known to compute F.layer_norm"
    return "no fusednorm equivalent"


def norm_report(model: nn.Module) -> NormReport:
    """Every norm module of `model` (named_modules order) and what fusednorm does with it:
    "fused" (already a fusednorm module), "swap" (replace_norms would swap it, detail:
    the new class) or "keep" (detail: why not). print() it for a summary.

        >>> fusednorm.replace_layernorm(model)
        >>> print(fusednorm.norm_report(model))
        25 norm modules: 25 fusednorm, 0 to swap, 0 kept
          fused: 25 fusednorm.modules.FusedLayerNorm
    """
    if not isinstance(model, nn.Module):
        raise FusedTypeError(f"norm_report: model must be an nn.Module, got {type(model).__name__}")
    return _plan(model, None)


def _swapped_class(module: nn.Module, target: type) -> type:
    """The class `module` takes: `target`, or for a parametrized module one made over
    `target` with the properties of its parametrized tensors, as torch.nn.utils.parametrize
    makes it: its own (parametrize adds and removes properties on it), so that forward reads
    weight and bias through their parametrizations and remove_parametrizations leaves a plain
    `target`."""
    if not parametrize.is_parametrized(module):
        return target
    own = {k: v for k, v in vars(type(module)).items()
           if k not in ("__dict__", "__weakref__", "__module__", "__qualname__")}
    return type(f"Parametrized{target.__name__}", (target,), own)


def swap_modules(model: nn.Module, families: tuple[str, ...], caller: str) -> NormReport:
    """Swaps, in place, every module of `model` whose class SWAPS lists under `families`;
    logs what it did at INFO level on the "fusednorm" logger, and warns when the model has
    norm modules but none is or becomes fusednorm's. Returns the plan it carried out."""
    if not isinstance(model, nn.Module):
        raise FusedTypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")
    plan = _plan(model, families)
    for entry in plan.entries:
        if entry.action == "swap":
            module = model.get_submodule(entry.name)
            swap = SWAPS[entry.cls]
            if swap.adapt is not None:
                swap.adapt(module)
            module.__class__ = _swapped_class(module, swap.target)
    swapped, fused, kept = plan.count("swap"), plan.count("fused"), plan.count("keep")
    message = f"{caller}: swapped {swapped} norm module(s)"
    if swapped:
        message += f" ({plan.summary('swap')})"
    if fused:
        message += f"; {fused} already fusednorm's"
    if kept:
        message += f"; kept {kept} ({plan.summary('keep')})"
    logger.info(message)
    if kept and not swapped and not fused:
        warnings.warn(f"{caller} swapped none of the model's {kept} norm module(s): "
                      f"{plan.summary('keep')}. fusednorm.norm_report(model) lists them.",
                      UserWarning, stacklevel=3)
    return plan


def replace_layernorm(model: nn.Module) -> nn.Module:
    """Turns every LayerNorm of `model` (the model itself included) whose class fusednorm
    knows to compute F.layer_norm into fusednorm's, in place, and returns the model.

    Swapped: torch.nn.LayerNorm and timm.layers.LayerNorm (-> FusedLayerNorm), timm's
    channels-first timm.layers.LayerNorm2d (-> FusedLayerNorm2d) and the other LayerNorm
    classes of fusednorm.patch.SWAPS (docs/models.md). Other subclasses of nn.LayerNorm
    are left alone, since they may compute something else. The modules keep their
    identity, Parameter objects (so optimizer state stays valid), device, dtype, hooks and
    train/eval mode: only their class changes.

    What was swapped is logged at INFO level (logger "fusednorm"); a UserWarning says so
    when the model has norm modules but none was swapped. fusednorm.norm_report(model)
    lists every norm module and what became of it.
    """
    swap_modules(model, REPLACE_FAMILIES["replace_layernorm"], "replace_layernorm")
    return model


def replace_norms(model: nn.Module) -> nn.Module:
    """replace_layernorm, and the same for RMSNorm: torch.nn.RMSNorm (-> FusedRMSNorm) and
    every transformers / timm norm class that docs/models.md lists as swapped (Llama-style
    RMSNorms -> FusedHFRMSNorm, T5's, Cohere's, ... -> the fusednorm.swap_targets class that
    keeps their order of operations and cast rule). In place, same Parameter objects;
    returns the model. Logging, warning and norm_report as replace_layernorm's."""
    swap_modules(model, REPLACE_FAMILIES["replace_norms"], "replace_norms")
    return model
