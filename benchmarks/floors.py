"""The memory floor of the norm suites, timed as a provider: an op that moves exactly the
bytes a pass must move, into freshly allocated outputs as every provider's are.

On the CPU, outputs above glibc's mmap threshold (32 MiB) are new pages on every call: the
kernel zeroes each page at its first touch, for every provider alike. A copy into a
preallocated tensor (the suite's copy bandwidth) skips that, so at large shapes no
out-of-place op can reach it; `fresh-copy` is what one can (pct_of_fresh_copy).
"""
from __future__ import annotations

import torch

from . import report

FRESH_COPY = "fresh-copy"
FLOOR_KEY = "pct_of_fresh_copy"


class _FreshCopy(torch.autograd.Function):
    """fwd: reads x (and the residual r), writes fresh copies (the outputs y, and s).
    bwd: reads what a norm's backward reads, x (with a residual: s, in its dtype) and the
    output gradients, and writes a fresh dx: dy + x (with a residual: ds + dy * s, one
    addcmul reading all three, in s's dtype; separate_dx: then copied into a new dx of x's
    dtype, as a backward that forms dx in a pass of its own)."""

    @staticmethod
    def forward(ctx, x, residual, separate_dx):
        if residual is None:
            ctx.save_for_backward(x)
            return x.clone()
        y, s = x.clone(), residual.clone()
        ctx.save_for_backward(s)  # what a norm's backward reads: the sum, in its dtype
        ctx.separate_dx = separate_dx
        return y, s

    @staticmethod
    def backward(ctx, *grads):
        (saved,) = ctx.saved_tensors
        if len(grads) == 1:
            return torch.add(grads[0], saved), None, None
        dy, ds = grads
        dr = torch.addcmul(ds, dy, saved)
        if not ctx.separate_dx:
            return dr, None, None
        return torch.empty_like(dy).copy_(dr), None, None


def fresh_copy(x: torch.Tensor, residual: torch.Tensor | None = None, separate_dx: bool = False):
    """The floor of a norm on rows of x (with a residual: of an add-norm); differentiable
    in x only. separate_dx: the backward writes the residual's gradient, then reads it
    again into dx (see norm_variants.Variant.distinct_input_grad; ATen ops write one output
    each, so this floor reads dr once more than fusednorm's one pass)."""
    return _FreshCopy.apply(x, residual, separate_dx)


NOTE = (f"{FRESH_COPY}: the floor of an out-of-place op, timed like the providers: it reads "
        "and writes the pass's rows and nothing else, into freshly allocated outputs (fwd: "
        "a clone of x (and r); bwd: dy + x, or ds + dy * s with a residual, then a copy of that "
        "into dx where the variant forms dx in a pass of its own). % of fresh-copy "
        "is its time over the provider's. Unlike the copy bandwidth (into a preallocated "
        "tensor), it pays what every provider pays for new outputs (under --cpu-memory fresh: "
        "the first-touch zeroing of fresh pages).")


def note(providers) -> str:
    """The notes' word on the floor: what it is, or that this run did not time it (a GPU
    run times it only when named or with --full: benchmarks/cli.py GPU_FULL_ONLY)."""
    if FRESH_COPY in providers:
        return NOTE
    return (f"{FRESH_COPY} (the floor of an op into freshly allocated outputs) not timed in "
            "this run: on the GPU the caching allocator makes new outputs free, so it reads "
            "about the copy bandwidth; --full or --providers naming it times it.")


def columns(providers) -> list[report.Column]:
    """The norm suites' table columns: ms, GB/s, % of the floor (when timed), x torch."""
    floor = [report.FRESH_COPY] if FRESH_COPY in providers else []
    return [report.MS, report.GBPS, *floor, report.SPEEDUP.without(FRESH_COPY)]
