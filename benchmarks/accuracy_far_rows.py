"""`python -m benchmarks.accuracy_far_rows`: how far from float64 the float32 gradients of
LayerNorm and of the LayerNorm + GELU-FFN block land when the rows sit far from zero
(offset + N(0, 1)), for fusednorm and for PyTorch eager. Not a timing: the figures behind
the README's "exact where others drift". Each entry is the largest error of one output over
the largest value of the float64 reference (relative to the tensor, not elementwise).

Writes <out>/<device>/accuracy_far_rows.{json,md}: bench-out/ by default, the committed
benchmarks/results/ with --save.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import functional, reference

from . import cli, report, stamp

SUITE = "accuracy_far_rows"
OFFSETS = (0.0, 1e2, 1e4)
LN_SHAPES = ((64, 1000), (16, 4096))
BLOCK_SHAPE = (32, 256)  # tokens, d (hidden 2d)
LN_OUTPUTS = ("y", "dx", "dweight", "dbias")
BLOCK_OUTPUTS = ("y", "dx", "dln_weight", "dln_bias", "dweight1", "dbias1", "dweight2", "dbias2")


def _errors(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-300)).item()
            for a, r in zip(ours, ref)]


def _run(fn, tensors: list[torch.Tensor], grad: torch.Tensor, dtype: torch.dtype):
    """fn's output and the gradients of every tensor, computed in dtype."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad.to(dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def layer_norm_rows(device: torch.device) -> list[dict]:
    rows = []
    for M, N in LN_SHAPES:
        g = torch.Generator().manual_seed(M * N)
        noise, weight, bias, grad = (torch.randn(*s, generator=g, dtype=torch.float64)
                                     for s in ((M, N), (N,), (N,), (M, N)))
        for offset in OFFSETS:
            # The float32 input, in float64 for the reference: both normalize the same values.
            x = (noise + offset).float().double().to(device)
            tensors = [x, (weight + 1).to(device), bias.to(device)]
            dy = grad.to(device)
            ref = _run(lambda x, w, b: reference.layer_norm(x, (N,), w, b), tensors, dy,
                       torch.float64)
            for provider, fn in (("fusednorm", fusednorm.layer_norm), ("torch", F.layer_norm)):
                got = _run(lambda x, w, b: fn(x, (N,), w, b), tensors, dy, torch.float32)
                rows.append({"op": "layer_norm", "M": M, "N": N, "offset": offset,
                             "provider": provider, **dict(zip(LN_OUTPUTS, _errors(got, ref)))})
    return rows


def block_rows(device: torch.device) -> list[dict]:
    M, d = BLOCK_SHAPE
    g = torch.Generator().manual_seed(5)
    def rand(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift
    noise = rand(M, d)
    params = [rand(d, shift=1.0), rand(d), rand(2 * d, d, scale=d**-0.5), rand(2 * d),
              rand(d, 2 * d, scale=(2 * d) ** -0.5), rand(d)]
    grad = rand(M, d).to(device)

    def eager(x, ln_w, ln_b, w1, b1, w2, b2):
        h = F.layer_norm(x, (d,), ln_w, ln_b)
        return x + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)

    rows = []
    for offset in OFFSETS:
        tensors = [(noise + offset).float().double().to(device)] + [p.to(device) for p in params]
        ref = _run(lambda x, *p: reference.layer_norm_gelu_ffn(x, p[0], p[1], 1e-5, *p[2:]),
                   tensors, grad, torch.float64)
        def fused(x, *p):
            return functional.layer_norm_gelu_ffn(x, p[0], p[1], 1e-5, *p[2:])

        for provider, fn in (("fusednorm", fused), ("torch", eager)):
            got = _run(fn, tensors, grad, torch.float32)
            rows.append({"op": "layer_norm_gelu_ffn", "M": M, "N": d, "offset": offset,
                         "provider": provider, **dict(zip(BLOCK_OUTPUTS, _errors(got, ref)))})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# {SUITE} on {result['device']}", "",
             f"{result['device_kind']}, torch {result['torch']}, fusednorm kernels: "
             f"{result['fusednorm_build']}, commit `{result['commit']}`, {result['date']}.", "",
             "float32 rows at offset + N(0, 1). Each entry: the largest error of the output or "
             "gradient against the float64 reference, over the reference's largest value.", ""]
    for op, outputs in (("layer_norm", LN_OUTPUTS), ("layer_norm_gelu_ffn", BLOCK_OUTPUTS)):
        lines += [f"## {op}", "", "| M | N | offset | provider | " + " | ".join(outputs) + " |",
                  "|---|---|---|---|" + "--:|" * len(outputs)]
        for row in result["rows"]:
            if row["op"] == op:
                cells = " | ".join(f"{row[o]:.1e}" for o in outputs)
                lines.append(f"| {row['M']} | {row['N']} | {row['offset']:g} | "
                             f"{row['provider']} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_far_rows",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="results root (default: bench-out, untracked)")
    where.add_argument("--save", action="store_true",
                       help="write into the committed benchmarks/results/<device>/")
    args = parser.parse_args(argv)
    args.quick = False
    cli.warn_unpublishable(args)
    device = cli.resolve_device(args.device)
    result = {**stamp.header(SUITE, device), "rows": layer_norm_rows(device) + block_rows(device)}
    md = markdown(result)
    print(md)
    folder = report.write(result, cli.out_root(args), md, lambda path: None)
    print(f"results written to {folder}", file=sys.stderr)


if __name__ == "__main__":
    main()
