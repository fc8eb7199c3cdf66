"""One norm-family op run a few times, for a profiler (scripts/gpu_check.sh's `profile`
phase runs it under Nsight Compute, which profiles one launch after the warm-up ones):

    python -m benchmarks.ncu_case layer_norm fwd bf16 16384 4096 [--device cuda] [--runs 3]

The forward runs `runs` times; the backward runs the forward once, then the backward `runs`
times. Inputs are seeded random values, so every run of a case launches the same kernels.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import availability, cli

OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
PASSES = ("fwd", "bwd")


def build_call(op: str, pass_: str, dtype: torch.dtype, M: int, N: int, device: str):
    """A callable that runs the case's pass once."""
    fusednorm = availability.import_fusednorm()
    if fusednorm is None:
        raise SystemExit("fusednorm is not importable (build it first)")
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    x, residual, dy = rand(M, N), rand(M, N), rand(M, N)
    weight, bias = rand(N), rand(N)
    leaves = [x, weight, bias] if "layer" in op else [x, weight]
    for t in leaves:
        t.requires_grad_(pass_ == "bwd")
    forward = {
        "layer_norm": lambda: fusednorm.layer_norm(x, (N,), weight, bias),
        "rms_norm": lambda: fusednorm.rms_norm(x, (N,), weight),
        "add_layer_norm": lambda: fusednorm.add_layer_norm(x, residual, (N,), weight, bias)[0],
        "add_rms_norm": lambda: fusednorm.add_rms_norm(x, residual, (N,), weight)[0],
    }[op]
    if pass_ == "fwd":
        return forward
    y = forward()
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ncu_case",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=OPS)
    parser.add_argument("pass_", metavar="pass", choices=PASSES)
    parser.add_argument("dtype", type=cli.parse_dtypes)
    parser.add_argument("M", type=int)
    parser.add_argument("N", type=int)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if len(args.dtype) != 1:
        raise SystemExit("dtype: one of fp32, bf16, fp16, fp64")
    call = build_call(args.op, args.pass_, args.dtype[0], args.M, args.N, args.device)
    for _ in range(args.runs):
        call()
    if args.device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
