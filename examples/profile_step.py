"""Where a training step of the example GPT spends its time, with PyTorch's LayerNorm/FFN and
with fusednorm's: torch.profiler over a few steps of each, after warm-up.

    python examples/profile_step.py OUT_DIR [--warmup 20] [--steps 10] [train_gpt.py options]

For each norm: the wall time per step, the time the device's kernels (CUDA) or the CPU's
operators were busy per step (a step whose wall time is well above it waits on the host), and the operators and kernels with the most self time per step, which is
what to compare when one model trains slower than the other. Writes OUT_DIR/profile.json
and OUT_DIR/profile.md and prints the latter.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NORMS = ("torch", "fused")
TOP = 25


def self_time_us(event, on_device: bool) -> float:
    # FunctionEventAvg names its device field self_device_time_total (self_cuda_time_total
    # before torch 2.4).
    if on_device:
        return getattr(event, "self_device_time_total", None) or getattr(
            event, "self_cuda_time_total", 0.0)
    return event.self_cpu_time_total


def profile_norm(norm: str, warmup: int, steps: int, extra: list[str]) -> dict:
    from train_gpt import Trainer, device_name, parse_args

    trainer = Trainer(parse_args(["--norm", norm, "--steps", str(warmup + steps + 1),
                                  "--out", os.devnull, "--no-progress", *extra]))
    on_device = trainer.device.type == "cuda"
    for _ in range(warmup):
        trainer.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step()  # ends with loss.item(): the device has finished the step
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if self_time_us(e, on_device) > 0]
    events.sort(key=lambda e: self_time_us(e, on_device), reverse=True)
    # On a GPU an operator's self device time is that of the kernels it launched, which
    # are rows of their own: only the kernels (and memcpys) add up to the device's time.
    rows = [{"name": e.key, "kind": "op" if e.device_type == DeviceType.CPU else "kernel",
             "calls_per_step": e.count / steps,
             "self_us_per_step": self_time_us(e, on_device) / steps} for e in events]
    busy_kind = "kernel" if on_device else "op"
    return {
        "norm": norm, "steps": steps, "device_kind": trainer.device.type,
        "device": device_name(trainer.device),
        "wall_ms_per_step": 1e3 * wall / steps,
        "busy_ms_per_step": sum(r["self_us_per_step"] for r in rows
                                if r["kind"] == busy_kind) / 1e3,
        "launches_per_step": sum(r["calls_per_step"] for r in rows if r["kind"] == "kernel"),
        "rows": rows,
    }


def markdown(results: list[dict], meta: dict) -> str:
    where = "device (CUDA kernels)" if results[0]["device_kind"] == "cuda" else "CPU operators"
    lines = [f"# Example GPT step profile, {meta['device']}", "",
             f"torch {meta['torch']}, commit `{meta['commit']}`, {meta['date']}, train_gpt options "
             f"`{' '.join(meta['options'])}`; {meta['warmup']} warm-up steps, then "
             f"{results[0]['steps']} profiled. Self time per step on the {where}.", "",
             "| norm | wall ms/step | busy ms/step | kernel launches/step |", "|---|--:|--:|--:|"]
    lines += [f"| {r['norm']} | {r['wall_ms_per_step']:.2f} | {r['busy_ms_per_step']:.2f} | "
              f"{r['launches_per_step']:g} |" for r in results]
    for r in results:
        lines += ["", f"## {r['norm']}: top {TOP} by self time", "",
                  "| self us/step | calls/step | kind | name |", "|--:|--:|---|---|"]
        lines += [f"| {row['self_us_per_step']:.1f} | {row['calls_per_step']:g} | "
                  f"{row['kind']} | `{row['name'][:110]}` |" for row in r["rows"][:TOP]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--warmup", type=int, default=20, help="steps before profiling")
    parser.add_argument("--steps", type=int, default=10, help="profiled steps")
    args, extra = parser.parse_known_args()
    # This checkout's fusednorm and the example's modules, as compare_speed.py does.
    for path in (str(HERE), str(REPO)):
        sys.path.insert(0, path)
    results = [profile_norm(norm, args.warmup, args.steps, extra) for norm in NORMS]
    from train_gpt import git_commit

    # The device the trainers ran on (whatever the spelling of --device in the options).
    meta = {"device": results[0]["device"], "torch": torch.__version__, "options": extra,
            "commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "warmup": args.warmup}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    md = markdown(results, meta)
    (args.out / "profile.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
