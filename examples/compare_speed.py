"""Training speed of the example GPT with PyTorch's norms/FFN and with fusednorm's, measured
in rounds of one run of each, back to back, the side that runs first alternating from round
to round (torch, fused, then fused, torch, ...), so that a machine that speeds up or slows
down during the measurement affects both sides alike.

    python examples/compare_speed.py OUT_DIR [--rounds 4] [--steps 30] [train_gpt.py options]
    python examples/compare_speed.py OUT_DIR --interleave [--rounds 4] [--steps 30] [...]

Each run is a fresh `examples/train_gpt.py` process (same seed, same data). Two rates per
run: tokens/s over the run's elapsed time, and the rate of its median step (a step that a
busy machine slowed down moves the median less). The ratio stated first is the median over
rounds of fused / torch median-step rates, each round's two runs adjacent in time (a
machine that drifts between rounds cancels out of it); torch runs first in even rounds
(0, 2, ...) and fused in odd ones, so a drift within rounds favours neither side when
--rounds is even (an odd count lets torch run first once more). The ratio of the medians of
the elapsed-time rates is given too. Writes OUT_DIR/speed.json (every run's rates, the
medians, the ratios, the order of the runs and which norm ran first in each round, device
and versions) and OUT_DIR/speed.md (the same as a table), and prints it.

--interleave: a machine whose speed changes within seconds (a shared VM) moves the rates of
adjacent runs apart by more than the difference measured. Then each round trains one model
of each norm in one process (this checkout's fusednorm), their steps alternating (torch
first in one pair of steps, fused first in the next), and each pair's ratio of step times
is taken a fraction of a second apart. The ratio stated first is the median over all timed
pairs of torch step time / fused step time; the ratio of the summed step times is given too.
Writes OUT_DIR/interleaved.json and OUT_DIR/interleaved.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NORMS = ("torch", "fused")


def round_order(index: int) -> tuple[str, ...]:
    """The norms of round index in the order they run: torch first in even rounds, fused
    first in odd ones, so that neither side always runs on the later, drifted machine."""
    return NORMS if index % 2 == 0 else NORMS[::-1]


def require_this_checkout(metrics: dict) -> None:
    """Stops unless a fused run's fusednorm came from this checkout, whose commit the
    results are stamped with (not, say, an editable install of another clone)."""
    source = metrics.get("fusednorm_file")
    if source is None or not Path(source).is_relative_to(REPO):
        raise SystemExit(f"the fused run imported fusednorm from {source}, not from {REPO}, "
                         "whose commit the results would name")


def run_once(norm: str, steps: int, extra: list[str], scratch: Path) -> dict:
    out = scratch / f"{norm}-{len(list(scratch.iterdir()))}"
    # This checkout's fusednorm first on the path: the results are stamped with its commit,
    # so the fused runs must not import another copy (an editable install of another clone).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, str(HERE / "train_gpt.py"), "--norm", norm, "--steps",
                    str(steps), "--out", str(out), "--no-progress", *extra], check=True, env=env)
    metrics = json.loads((out / "metrics.json").read_text())
    if norm == "fused":
        require_this_checkout(metrics)
    return metrics


def summarize(runs: list[dict]) -> dict:
    by_norm = {n: [r["tokens_per_s"] for r in runs if r["norm"] == n] for n in NORMS}
    medians = {n: statistics.median(v) for n, v in by_norm.items()}
    step_rates = {n: [r["median_step_tokens_per_s"] for r in runs if r["norm"] == n]
                  for n in NORMS}
    round_ratios = [f / t for t, f in zip(step_rates["torch"], step_rates["fused"])]
    first = runs[0]
    return {
        "device": first["device"], "device_kind": first["device_kind"],
        "threads": first["threads"], "torch": first["torch"], "commit": first["commit"],
        "date": first["date"], "config": first["config"],
        "order": [r["norm"] for r in runs],
        "first_by_round": [r["norm"] for r in runs[::len(NORMS)]],  # a round: one run per norm
        "tokens_per_s": by_norm,
        "median_tokens_per_s": medians,
        "fused_over_torch": medians["fused"] / medians["torch"],
        "median_step_tokens_per_s": step_rates,
        "round_ratios": round_ratios,
        "fused_over_torch_by_round": statistics.median(round_ratios),
        "rounds_fused_ahead": sum(r > 1 for r in round_ratios),
        "final_loss": {n: next(r["losses"][-1] for r in runs if r["norm"] == n) for n in NORMS},
    }


def markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = [
        f"# Example GPT training speed on {summary['device']}",
        "",
        f"{summary['device_kind']}, {summary['threads']} threads, torch {summary['torch']}, "
        f"commit `{summary['commit']}`, {summary['date']}; {cfg['n_layer']} layers, "
        f"d_model {cfg['d_model']}, batch {cfg['batch_size']} x {cfg['block_size']} tokens, "
        f"{cfg['amp']}, {cfg['steps']} steps per run (the first tenth untimed). A round is "
        "a run of each norm, back to back; first in each round: "
        f"{', '.join(summary['first_by_round'])}.",
        "",
        "| norm | tokens/s per run (elapsed) | median | median-step tokens/s per run | "
        "median | final loss |",
        "|---|---|--:|---|--:|--:|",
    ]
    for n in NORMS:
        per_run = ", ".join(f"{v:.0f}" for v in summary["tokens_per_s"][n])
        per_step = ", ".join(f"{v:.0f}" for v in summary["median_step_tokens_per_s"][n])
        lines.append(f"| {n} | {per_run} | {summary['median_tokens_per_s'][n]:.0f} | "
                     f"{per_step} | "
                     f"{statistics.median(summary['median_step_tokens_per_s'][n]):.0f} | "
                     f"{summary['final_loss'][n]:.4f} |")
    ratios = ", ".join(f"{r:.3f}" for r in summary["round_ratios"])
    lines += [
        "",
        f"fused / torch, median over rounds of the median-step rates: "
        f"**{summary['fused_over_torch_by_round']:.3f}x** (fused ahead in "
        f"{summary['rounds_fused_ahead']} of {len(summary['round_ratios'])} rounds; "
        f"per round: {ratios})",
        "",
        f"fused / torch, medians of the elapsed-time rates: {summary['fused_over_torch']:.3f}x",
    ]
    return "\n".join(lines) + "\n"


def interleaved_rounds(rounds: int, steps: int, extra: list[str]) -> list[dict]:
    """Per round: a model of each norm trained in this process, one step of each in turn;
    returns each round's two metrics dicts (train_gpt's), torch's first."""
    # This checkout's fusednorm and the example's modules, as in run_once's processes.
    for path in (str(HERE), str(REPO)):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
    from train_gpt import Trainer, parse_args

    results = []
    for _ in range(rounds):
        trainers = {norm: Trainer(parse_args(["--norm", norm, "--steps", str(steps),
                                              "--out", os.devnull, "--no-progress", *extra]))
                    for norm in NORMS}
        for step in range(steps):
            for norm in NORMS if step % 2 == 0 else reversed(NORMS):
                trainers[norm].step()
        results.append({norm: trainer.metrics() for norm, trainer in trainers.items()})
    require_this_checkout(results[0]["fused"])
    return results


def summarize_interleaved(results: list[dict]) -> dict:
    # Step i of either model ran right after or before step i of the other.
    pair_ratios = [t / f for r in results
                   for t, f in zip(r["torch"]["step_ms"], r["fused"]["step_ms"])]
    total_ms = {n: sum(sum(r[n]["step_ms"]) for r in results) for n in NORMS}
    first = results[0]["torch"]
    return {
        "device": first["device"], "device_kind": first["device_kind"],
        "threads": first["threads"], "torch": first["torch"], "commit": first["commit"],
        "date": first["date"], "config": first["config"], "rounds": len(results),
        "step_ms": {n: [r[n]["step_ms"] for r in results] for n in NORMS},
        "pair_ratios": pair_ratios,
        "fused_speedup_by_pair": statistics.median(pair_ratios),
        "pairs_fused_ahead": sum(r > 1 for r in pair_ratios),
        "fused_speedup_by_total": total_ms["torch"] / total_ms["fused"],
        "median_step_ms": {n: statistics.median(ms for r in results for ms in r[n]["step_ms"])
                           for n in NORMS},
        "final_loss": {n: [r[n]["losses"][-1] for r in results] for n in NORMS},
    }


def markdown_interleaved(summary: dict) -> str:
    cfg = summary["config"]
    ratios = sorted(summary["pair_ratios"])
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    lines = [
        f"# Example GPT training speed on {summary['device']}, steps interleaved",
        "",
        f"{summary['device_kind']}, {summary['threads']} threads, torch {summary['torch']}, "
        f"commit `{summary['commit']}`, {summary['date']}; {cfg['n_layer']} layers, "
        f"d_model {cfg['d_model']}, batch {cfg['batch_size']} x {cfg['block_size']} tokens, "
        f"{cfg['amp']}, {summary['rounds']} rounds of {cfg['steps']} steps per model (the "
        "first tenth untimed). In each round one model of each norm trains in one process, "
        "their steps alternating (torch first, then fused first, ...).",
        "",
        "| norm | median step ms | summed step ms | final loss per round |",
        "|---|--:|--:|---|",
    ]
    for n in NORMS:
        total = sum(sum(ms) for ms in summary["step_ms"][n])
        losses = ", ".join(f"{v:.4f}" for v in summary["final_loss"][n])
        lines.append(f"| {n} | {summary['median_step_ms'][n]:.1f} | {total:.0f} | {losses} |")
    lines += [
        "",
        f"fused speed-up (torch step time / fused step time), median over "
        f"{len(ratios)} pairs of adjacent steps: **{summary['fused_speedup_by_pair']:.3f}x** "
        f"(fused faster in {summary['pairs_fused_ahead']} pairs; quartiles "
        f"{quartiles[0]:.3f}, {quartiles[2]:.3f}; range {ratios[0]:.3f}-{ratios[-1]:.3f})",
        "",
        f"fused speed-up, summed step times: {summary['fused_speedup_by_total']:.3f}x",
    ]
    return "\n".join(lines) + "\n"


def write_results(out: Path, stem: str, summary: dict, md: str) -> dict:
    """Writes OUT/<stem>.json and OUT/<stem>.md, prints the table; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=4,
                        help="runs of each norm (without --interleave: an even count lets "
                             "each norm run first in as many rounds)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--interleave", action="store_true",
                        help="alternate the two models' steps in one process (see above)")
    args, extra = parser.parse_known_args(argv)
    if args.rounds < 1 or args.steps < 2:
        parser.error("--rounds must be >= 1 and --steps >= 2")
    if args.interleave:
        summary = summarize_interleaved(interleaved_rounds(args.rounds, args.steps, extra))
        return write_results(args.out, "interleaved", summary, markdown_interleaved(summary))
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            for norm in round_order(index):
                runs.append(run_once(norm, args.steps, extra, Path(scratch)))
    summary = summarize(runs)
    return write_results(args.out, "speed", summary, markdown(summary))


if __name__ == "__main__":
    main()
