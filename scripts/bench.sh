#!/usr/bin/env bash
# The README's benchmark command: install fusednorm with its bench extras, then run every
# suite (GPU mode when torch sees a GPU, CPU mode otherwise), printing the tables and
# writing the files to the untracked bench-out/<device>/ (--save: into the committed
# benchmarks/results/<device>/). Extra arguments go to `python -m benchmarks` (e.g. --quick,
# --suites layer_norm, --out DIR, --save).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh bench
exec "${PYTHON:-python3}" -m benchmarks "$@"
