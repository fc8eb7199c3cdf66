"""The memory floor of the norm suites, timed as a provider: an op that moves exactly the
bytes a pass must move, into freshly allocated outputs as every provider's are.

On the CPU, outputs above glibc's mmap threshold (32 MiB) are new pages on every call: the
kernel zeroes each page at its first touch, for every provider alike. A copy into a
preallocated tensor (the suite's copy bandwidth) skips that, so at large shapes no
out-of-place op can reach it; `fresh-copy` is what one can (pct_of_fresh_copy).
"""
from __future__ import annotations

import torch

FRESH_COPY = "fresh-copy"
FLOOR_KEY = "pct_of_fresh_copy"


class _FreshCopy(torch.autograd.Function):
    """fwd: reads x (and the residual r), writes fresh copies (the outputs y, and s).
    bwd: reads x and the output gradients, writes a fresh dx: dy + x (+ ds * x with a
    residual: one addcmul reads all three)."""

    @staticmethod
    def forward(ctx, x, residual):
        ctx.save_for_backward(x)
        return x.clone() if residual is None else (x.clone(), residual.clone())

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        if len(grads) == 1:
            return torch.add(grads[0], x), None
        dy, ds = grads
        return torch.addcmul(ds, dy, x), None


def fresh_copy(x: torch.Tensor, residual: torch.Tensor | None = None):
    """The floor of a norm on rows of x (with a residual: of an add-norm); differentiable
    in x only."""
    return _FreshCopy.apply(x, residual)


NOTE = (f"{FRESH_COPY}: the floor of an out-of-place op, timed like the providers: it reads "
        "and writes the pass's rows and nothing else, into freshly allocated outputs (fwd: "
        "a clone of x (and r); bwd: dy + x, or ds + dy * x with a residual). % of fresh-copy "
        "is its time over the provider's. Unlike the copy bandwidth (into a preallocated "
        "tensor), it pays what every provider pays for new outputs (under --cpu-memory fresh: "
        "the first-touch zeroing of fresh pages).")
