"""`python -m benchmarks.sass_figures`: the static figure of merit of the CUDA norm kernels,
read from the compiled library's machine code (cuobjdump, no GPU needed): SASS instructions
per element for every forward and backward bucket of LayerNorm and RMSNorm, each input and
parameter dtype, vector (16-byte packs) and one-element layout, clustered or not. The
residual is a runtime pointer of the same kernels (no path of its own), so it has no row; a
float32 residual stream's kernels (float math, 16-bit x, y and dy) have rows of their own
(io_dtype).

Definition (also written into the results file):
  instructions     the static SASS instruction count of the kernel instantiation (every
                   instruction cuobjdump lists, NOP padding left out): setup, the per-row loop
                   with its fully unrolled per-element code, the row reductions, the stores;
  elements/thread  ITEMS x VEC: the elements one thread holds of a row (of a chunk, for the
                   clustered kernels), VEC = 16 / element size for pack kernels, 1 otherwise;
  per element      instructions / (ITEMS x VEC).
The per-element code is unrolled ITEMS x VEC times, so this figure moves when a kernel's work
per element changes (and, divided over its elements, when its per-row work does). It is a
static count: Nsight's executed instructions per element (36 for the bf16 LayerNorm forward,
docs/gpu_runs/README.md) also count loop trips and rows per thread.

    python -m benchmarks.sass_figures [--out benchmarks/results/sass] [--library PATH...]

writes <out>/sass_figures.json and .md (stamped: benchmarks/stamp.py) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .stamp import REPO_ROOT, fusednorm_build, git_commit, iso_now

sys.path.insert(0, str(REPO_ROOT / "tests"))
from sass_inspect import extension_path, find_tool, read_kernels, row_kernel  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "sass"
DEFINITION = (
    "instr_per_elem = static SASS instructions of the kernel instantiation (NOPs left out) / "
    "(ITEMS x VEC), the elements one thread holds of a row (of a chunk when clustered); "
    "VEC = 16 bytes / element size for pack kernels, 1 for one-element kernels")


def figures(kernels: dict) -> list[dict]:
    """One row per norm row kernel (read_kernels' output), sorted by arch, pass, kind, dtype,
    parameter dtype, layout and bucket."""
    rows = []
    for k in kernels.values():
        rk = row_kernel(k.name)
        if rk is None:
            continue
        instructions = sum(n for op, n in k.ops.items() if not op.startswith("NOP"))
        elements = rk.items * rk.vec
        rows.append({
            "arch": k.arch, "pass": rk.direction,
            "kind": "layer_norm" if rk.centered else "rms_norm",
            "dtype": rk.dtype, "param_dtype": rk.param, "io_dtype": rk.io,
            "layout": "pack" if rk.vectorized else "scalar", "cluster": rk.cluster,
            "tpr": rk.tpr, "items": rk.items, "vec": rk.vec,
            "row_elements": rk.tpr * elements,
            "instructions": instructions, "elements_per_thread": elements,
            "instr_per_elem": round(instructions / elements, 2), "registers": k.regs,
        })
    order = ("arch", "pass", "kind", "dtype", "io_dtype", "param_dtype", "layout", "cluster",
             "row_elements")
    rows.sort(key=lambda r: tuple(r[f] for f in order))
    return rows


def _dtype_cell(row: dict) -> str:
    """The math's dtype; a float32 residual stream's kernels also name their x/y/dy dtype."""
    io = row.get("io_dtype", row["dtype"])
    return row["dtype"] if io == row["dtype"] else f"{row['dtype']} ({io} x, y, dy)"


def markdown(result: dict) -> str:
    lines = [f"# SASS instructions per element: {result['fusednorm_build']}, commit "
             f"{result['commit']}, {result['date']}", "",
             f"Read from: {', '.join(result['read']) or 'fusednorm._C'}.", "",
             result["definition"], "",
             "| arch | pass | kind | dtype | params | layout | cluster | threads x items "
             "| row elements | instructions | per element | registers |",
             "|---|---|---|---|---|---|---|---|--:|--:|--:|--:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['arch']} | {r['pass']} | {r['kind']} | {_dtype_cell(r)} | {r['param_dtype']} | "
            f"{r['layout']} | {'yes' if r['cluster'] else 'no'} | {r['tpr']} x {r['items']} | "
            f"{r['row_elements']} | {r['instructions']} | {r['instr_per_elem']:.2f} | "
            f"{r['registers']} |")
    return "\n".join(lines) + "\n"


def result_of(rows: list[dict], read: list[str] | None = None) -> dict:
    """The results file's object; `read`: the files the figures came from."""
    import torch

    return {"suite": "sass_figures", "torch": torch.__version__,
            "fusednorm_build": fusednorm_build(), "commit": git_commit(), "date": iso_now(),
            "read": [Path(p).name for p in read or []], "definition": DEFINITION, "rows": rows}


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sass_figures.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "sass_figures.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sass_figures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--library", nargs="+",
                        help="the compiled fusednorm._C (default: the one imported), or the "
                             "CUDA object files of a build (build/temp*/build/generated/cuda/*.o)")
    args = parser.parse_args(argv)
    libraries = args.library or [extension_path()]
    tool = find_tool("cuobjdump")
    if None in libraries or tool is None:
        raise SystemExit(f"needs fusednorm's compiled library ({libraries}) and cuobjdump ({tool})")
    kernels = {}
    for library in libraries:
        kernels.update(read_kernels(library, tool))
    rows = figures(kernels)
    if not rows:
        raise SystemExit(f"no norm row kernels in {libraries}: built without CUDA kernels?")
    result = result_of(rows, libraries)
    write(result, args.out)
    print(markdown(result))


if __name__ == "__main__":
    main()
