#!/usr/bin/env bash
# Trains the example GPT once with PyTorch's LayerNorm and once with fusednorm's, same seed,
# then plots both loss curves into one PNG with a summary table beside it.
#   bash examples/run_comparison.sh OUT_DIR [train_gpt.py options, e.g. --device cuda --amp bf16]
# Writes OUT_DIR/{torch,fused}/metrics.json, their loss_curve.png, and OUT_DIR/loss_curves.png,
# comparison.json and comparison.md.
# A relative OUT_DIR is taken from the folder the script is called from.
set -euo pipefail
out=${1:?usage: run_comparison.sh OUT_DIR [train_gpt.py options]}
shift
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
for norm in torch fused; do
  "$PYTHON" examples/train_gpt.py --norm "$norm" --out "$out/$norm" "$@"
done
"$PYTHON" examples/compare_runs.py "$out/torch" "$out/fused" --out "$out/loss_curves.png"
