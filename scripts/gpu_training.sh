#!/usr/bin/env bash
# Issue 41's training comparison as one device call: examples/train_gpt.py on GPT-2 small
# (12 layers, d 768, 12 heads, context 1024, GPT-2's tanh GELU, bf16 autocast), fusednorm
# against PyTorch:
#
#   1. build fusednorm for the visible GPU (gpu_check.sh's build phase; skipped when
#      SKIP_BUILD=1, e.g. on a warm machine after scripts/gpu_session.sh);
#   2. eager, steps interleaved in one process (examples/compare_speed.py --interleave):
#      tokens/s as the median of adjacent step pairs, and each side's final loss;
#   3. the same with torch.compile on both sides (--compile);
#   4. whole runs, torch then fused, eager (examples/run_comparison.sh): each side's peak
#      memory (the CUDA allocator's, one model per process) and both loss curves.
#
#   bash scripts/gpu_training.sh    results in gpu_training_results/training/, packed into
#                                   $OUT/gpu_training.tar.gz (no $OUT: beside the folder)
#   DEADLINE_S=540      seconds in all; each step runs under the time left
#   GPT_ARGS="..."      the model and device options (default: GPT-2 small on cuda, above)
#   STEPS=100 ROUNDS=2  optimizer steps per model and round; rounds of the interleaved runs
#   SOURCE_COMMIT, SOURCE_TREE   stamp results with that commit when the files make that tree
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh training
GPT_ARGS=${GPT_ARGS:---device cuda --amp bf16 --n-layer 12 --n-head 12 --d-model 768 --block-size 1024 --batch-size 8 --gelu tanh}
STEPS=${STEPS:-100}
ROUNDS=${ROUNDS:-2}

log "start; commit ${FUSEDNORM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; $GPT_ARGS"

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  t=$(left)
  step build "$t" env DEADLINE_S="$t" PHASES=build bash scripts/gpu_check.sh "$DIR/check_build" ||
    { log "build failed: stopping"; exit 1; }
fi

# shellcheck disable=SC2086  # GPT_ARGS is a list of options
step eager "$(left)" "$PYTHON" examples/compare_speed.py "$DIR/eager" --interleave \
  --rounds "$ROUNDS" --steps "$STEPS" $GPT_ARGS
# shellcheck disable=SC2086
step compiled "$(left)" "$PYTHON" examples/compare_speed.py "$DIR/compiled" --interleave \
  --rounds "$ROUNDS" --steps "$STEPS" --compile $GPT_ARGS
# shellcheck disable=SC2086
step whole_runs "$(left)" env PYTHON="$PYTHON" bash examples/run_comparison.sh "$DIR/whole_runs" \
  --steps "$STEPS" --no-progress $GPT_ARGS
log "done"
# The device tool's reply carries the end of the output.
cat "$DIR/session.log" "$DIR"/eager/interleaved.md "$DIR"/compiled/interleaved.md \
  "$DIR"/whole_runs/comparison.md 2>/dev/null
