"""Correctness gate run once per provider and case before any timing: a benchmark of a
wrong kernel is worthless."""
from __future__ import annotations

from typing import Sequence

import torch

# Relative-error floor per dtype (‖out − ref64‖ / ‖ref64‖). A provider passes an output
# when its error is at most max(2 × PyTorch eager's error, floor): docs/DESIGN.md's "about
# twice PyTorch's own error", with room for rounding that eager happens to avoid.
REL_ERROR_FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.float16: 4e-3,
    torch.bfloat16: 1.6e-2,
}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf for a shape mismatch, NaN if out has NaN."""
    if out.shape != ref.shape:
        return float("inf")
    ref64 = ref.double()
    diff = torch.linalg.vector_norm(out.double() - ref64).item()
    return diff / max(torch.linalg.vector_norm(ref64).item(), 1e-300)


def failures(
    names: Sequence[str],
    errors: Sequence[float],
    baseline_errors: Sequence[float] | None,
    dtype: torch.dtype,
) -> list[str]:
    """Messages for the outputs whose error is over the limit (empty list: passed)."""
    floor = REL_ERROR_FLOOR[dtype]
    bad = []
    for i, (name, err) in enumerate(zip(names, errors)):
        limit = floor if baseline_errors is None else max(2 * baseline_errors[i], floor)
        if not err <= limit:  # NaN fails too
            bad.append(f"{name}: relative error {err:.2e} > limit {limit:.2e}")
    return bad
