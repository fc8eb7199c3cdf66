"""Plot the loss curves of train_gpt.py runs into one PNG and summarise them.

    python examples/compare_runs.py runs/torch runs/fused --out runs/loss_curves.png

Each argument is a run directory (holding metrics.json) or a metrics.json file. Beside
the PNG it writes comparison.json (max |loss difference| of every run against the first,
tokens/s, peak memory, the runs' device, torch, commit and date) and comparison.md (the same
as a Markdown table), and prints the table. Runs whose configuration differs beyond the
norm (seed, dtype, model size, steps, ...) are named in both and on stderr: their loss
difference is not the kernels' rounding.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_metrics(path: Path) -> dict:
    path = Path(path)
    return json.loads((path / "metrics.json" if path.is_dir() else path).read_text())


def label(metrics: dict) -> str:
    config = metrics.get("config", {})
    extras = [config.get("amp", "fp32")] + (["compile"] if config.get("compile") else [])
    return f"{metrics['norm']} ({metrics.get('device_kind', '?')}, {', '.join(extras)})"


def max_loss_diff(a: dict, b: dict) -> float:
    """Largest per-step |loss difference| over the steps both runs have."""
    pairs = list(zip(a["losses"], b["losses"]))
    if not pairs:
        raise ValueError("the runs have no steps in common")
    return max(abs(x - y) for x, y in pairs)


def plot_runs(runs: list[dict], path: Path, title: str | None = None) -> Path:
    """Loss per step of every run; with two or more runs, a second panel shows each run's
    difference from the first. Writes a PNG to `path` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if len(runs) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.2 * panels + 0.6), sharex=True,
                             squeeze=False, height_ratios=[2, 1][:panels])
    loss_ax = axes[0][0]
    for run in runs:
        loss_ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=label(run))
    loss_ax.set_ylabel("training loss (nats / byte)")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    if panels == 2:
        diff_ax = axes[1][0]
        base = runs[0]
        for run in runs[1:]:
            diffs = [x - y for x, y in zip(run["losses"], base["losses"])]
            diff_ax.plot(range(1, len(diffs) + 1), diffs,
                         label=f"{label(run)} − {label(base)}")
        diff_ax.axhline(0.0, color="black", linewidth=0.6)
        diff_ax.set_ylabel("loss difference")
        diff_ax.legend(fontsize="small")
        diff_ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    config = runs[0].get("config", {})
    default_title = (
        f"GPT {config.get('n_layer')}×{config.get('d_model')} on stdlib docstrings, "
        f"seed {config.get('seed')}, {runs[0].get('device', '')}"
    )
    fig.suptitle(title or default_title, fontsize="medium")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def config_differences(runs: list[dict]) -> dict:
    """{key: [each run's value]} for every config entry (and the device) on which the runs
    differ: a comparison of the norms is like for like only when this is empty."""
    def settings(run: dict) -> dict:
        return {**run.get("config", {}), "device": run.get("device")}

    all_settings = [settings(run) for run in runs]
    keys = sorted(set().union(*all_settings), key=str)
    return {key: [s.get(key) for s in all_settings] for key in keys
            if any(s.get(key) != all_settings[0].get(key) for s in all_settings)}


def summarize(runs: list[dict]) -> dict:
    """Per run: label, final loss, val loss, tokens/s, peak memory, and the max |loss
    difference| from the first run."""
    return {
        "runs": [
            {
                "label": label(run),
                "norm": run["norm"],
                "steps": len(run["losses"]),
                "first_loss": run["losses"][0],
                "final_loss": run["losses"][-1],
                "val_loss": run.get("val_loss"),
                "tokens_per_s": run["tokens_per_s"],
                "peak_mem_mb": run["peak_mem_mb"],
                "peak_mem_kind": run.get("peak_mem_kind"),
                "max_abs_loss_diff_vs_first": max_loss_diff(run, runs[0]),
            }
            for run in runs
        ],
        "device": runs[0].get("device"),
        "torch": runs[0].get("torch"),
        "commit": runs[0].get("commit"),
        "date": runs[0].get("date"),
        "config_differences": config_differences(runs),
    }


def markdown_table(summary: dict) -> str:
    lines = [
        f"{summary.get('device')}, torch {summary.get('torch')}, commit "
        f"`{summary.get('commit')}`, {summary.get('date')} (the first run's)",
        "",
        "| run | steps | first loss | final loss | val loss | tokens/s | peak mem (MB) "
        "| max abs loss diff vs first |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in summary["runs"]:
        val = "" if run["val_loss"] is None else f"{run['val_loss']:.4f}"
        lines.append(
            f"| {run['label']} | {run['steps']} | {run['first_loss']:.4f} "
            f"| {run['final_loss']:.4f} | {val} | {run['tokens_per_s']:.0f} "
            f"| {run['peak_mem_mb']:.0f} | {run['max_abs_loss_diff_vs_first']:.2e} |"
        )
    differences = summary.get("config_differences")
    if differences:
        lines += ["", "The runs differ beyond the norm, so their loss difference is not only "
                  "the kernels' rounding: " + difference_text(differences) + "."]
    return "\n".join(lines) + "\n"


def difference_text(differences: dict) -> str:
    return "; ".join(f"{key} {' / '.join(map(str, values))}"
                     for key, values in differences.items())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or metrics.json")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = [load_metrics(path) for path in args.runs]
    plot_runs(runs, args.out, args.title)
    summary = summarize(runs)
    table = markdown_table(summary)
    if summary["config_differences"]:
        print("compare_runs: the runs differ beyond the norm: "
              + difference_text(summary["config_differences"]), file=sys.stderr)
    args.out.with_name("comparison.json").write_text(json.dumps(summary, indent=1) + "\n")
    args.out.with_name("comparison.md").write_text(table)
    print(table, end="")
    return summary


if __name__ == "__main__":
    main()
