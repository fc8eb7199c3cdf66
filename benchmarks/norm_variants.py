"""The variants of the add_* suites' sum s = input + residual: what each passes to fusednorm,
how PyTorch eager writes it, the sum's dtype and the dropout mask a provider drew.

- `plain`: s = x + r in x's dtype.
- `fp32-residual`: residual_dtype=torch.float32 beside a 16-bit x (bf16 activations, a
  float32 residual stream): r and s float32, the norm's output in x's dtype.
- `dropout`, `dropout-rowscale`: s = dropout(x, 0.1) (* rowscale[row]) + r, rowscale float32
  (float64 for float64 x) of the leading dims' shape, not differentiable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

DROPOUT_P = 0.1
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Variant:
    """One variant of the sum: its name in the rows and fusednorm's options for it."""

    name: str  # the rows' "variant"
    description: str
    residual_dtype: torch.dtype | None = None
    dropout_p: float = 0.0
    rowscale: bool = False

    def applies_to(self, dtype: torch.dtype) -> bool:
        """A float32 residual stream is another computation only beside a 16-bit input."""
        return self.residual_dtype is None or dtype in HALF

    def sum_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of r, s and their gradients for an input of `dtype`."""
        return self.residual_dtype if self.residual_dtype and dtype in HALF else dtype

    @property
    def random(self) -> bool:
        return self.dropout_p > 0

    @property
    def distinct_input_grad(self) -> bool:
        """Whether dx differs from the residual's gradient dr (a float32 dr rounded to x's
        dtype, or dropout's multipliers applied), so that the backward writes both (fusednorm:
        in its one pass over the rows, norm_bwd's grad_x) instead of one gradient for both."""
        return self.residual_dtype is not None or self.random or self.rowscale

    def fused_kwargs(self, rowscale: torch.Tensor | None) -> dict:
        """fusednorm's keyword arguments (none for `plain`, which any build takes)."""
        kwargs: dict = {}
        if self.residual_dtype is not None:
            kwargs["residual_dtype"] = self.residual_dtype
        if self.random:
            kwargs["dropout_p"] = self.dropout_p
        if rowscale is not None:
            kwargs["rowscale"] = rowscale
        return kwargs

    @property
    def options(self) -> str:
        """fusednorm's keyword arguments as text, for messages."""
        return ", ".join(f"{k}=" + ("<[M] tensor>" if k == "rowscale" else str(v))
                         for k, v in self.fused_kwargs(torch.empty(0) if self.rowscale
                                                       else None).items())

    def eager(self, norm: Callable) -> Callable:
        """PyTorch eager as a user writes it, (x, r, w, rowscale) -> (norm(s), s); norm(s, w)
        is the suite's norm. The float32 stream: s = x.float() + r, the norm in float32 (the
        weight cast to it: F.layer_norm refuses a bfloat16 weight beside a float32 input),
        rounded to x's dtype. Dropout: F.dropout(x, p) * rowscale[..., None] + r, rowscale
        cast to x's dtype (else type promotion makes s float32: another computation)."""
        def function(x, r, w, rowscale):
            h = F.dropout(x, self.dropout_p) if self.random else x
            if rowscale is not None:
                h = h * rowscale[..., None].to(x.dtype)
            s = h.to(r.dtype) + r
            return norm(s, w.to(s.dtype)).to(x.dtype), s
        function.__name__ = f"eager_{self.name.replace('-', '_')}"
        return function


PLAIN = Variant("plain", "s = x + r in x's dtype")
FP32_RESIDUAL = Variant(
    "fp32-residual", "residual_dtype=torch.float32: 16-bit x, float32 r and s (s = x.float() + "
    "r), the output in x's dtype", residual_dtype=torch.float32)
DROPOUT = Variant("dropout", f"dropout_p={DROPOUT_P}: s = dropout(x, {DROPOUT_P}) + r",
                  dropout_p=DROPOUT_P)
DROPOUT_ROWSCALE = Variant(
    "dropout-rowscale", f"dropout_p={DROPOUT_P} and rowscale: s = dropout(x, {DROPOUT_P}) * "
    "rowscale[row] + r, rowscale float32 [M]", dropout_p=DROPOUT_P, rowscale=True)
VARIANTS = {v.name: v for v in (PLAIN, FP32_RESIDUAL, DROPOUT, DROPOUT_ROWSCALE)}


def rowscale_for(variant: Variant, M: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """A rowscale of M values in [0.5, 1.5) (never 0: a zero row would read as dropped)."""
    if not variant.rowscale:
        return None
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.rand(M, device=device, dtype=wide) + 0.5


def kept_mask(dx: torch.Tensor, p: float, dsum: torch.Tensor | None = None) -> torch.Tensor:
    """The elements a provider's dropout kept, read from its input gradient: exactly zero
    where dropped, and where kept zero only when the sum's gradient dsum (the residual's
    gradient) is: a 16-bit dsum, the sum of two rounded gradients, is exactly zero for
    about 1 element in 2000 (torch eager, bfloat16), so where dsum is zero an element counts
    as kept (its reference gradient is then as small as that rounding). Raises ValueError
    when the kept share is more than 6 standard deviations from 1 - p: a provider that drops
    nothing, or everything, is wrong whatever its values."""
    kept = dx != 0
    if dsum is not None:
        kept |= dsum == 0
    n = kept.numel()
    share = kept.sum().item() / n
    allowed = 6 * math.sqrt(p * (1 - p) / n) + 1 / n
    if abs(share - (1 - p)) > allowed:
        raise ValueError(f"dropout kept {share:.4f} of the elements, expected {1 - p:.4f} "
                         f"± {allowed:.4f}")
    return kept
