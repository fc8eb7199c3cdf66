#!/usr/bin/env bash
# The CUDA kernels under NVIDIA compute-sanitizer: runs the tests marked `sanitize` (one
# shape per kernel path, see tests/test_layer_norm_cuda.py and the clustered long rows of
# tests/test_layer_norm_cuda_long_rows.py) under each tool and fails on the first error the
# tool reports.
#
#   bash tests/sanitize.sh                  memcheck, then racecheck
#   TOOLS="memcheck racecheck initcheck synccheck" bash tests/sanitize.sh
#   bash tests/sanitize.sh -k 1024          extra arguments go to pytest
#
# memcheck: out-of-bounds and misaligned global/shared accesses. PyTorch's caching allocator
# is switched off so that every tensor is its own allocation and reading past one is caught.
# racecheck: shared-memory hazards (missing barriers). synccheck: invalid barrier use
# (TOOLS="memcheck racecheck synccheck", as scripts/gpu_check.sh runs). Needs a GPU and
# fusednorm built with its CUDA kernels (for line numbers in reports, build with
# FUSEDNORM_DEBUG=1 or keep the default -lineinfo). SANITIZER_ARGS adds options, e.g. a kernel-name filter.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
if [[ ! -x "$SANITIZER" ]]; then
  echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
"$PYTHON" - <<'EOF'
import sys
import torch
import fusednorm
if not (torch.cuda.is_available() and fusednorm.build_info()["cuda_kernels"]):
    sys.exit("sanitize.sh: needs a CUDA GPU and fusednorm built with CUDA kernels")
EOF

status=0
for tool in ${TOOLS:-memcheck racecheck}; do
  echo "== compute-sanitizer --tool $tool"
  # shellcheck disable=SC2086  # SANITIZER_ARGS is a list of options
  if ! PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" --error-exitcode 97 \
      ${SANITIZER_ARGS:-} \
      "$PYTHON" -m pytest -q -p no:cacheprovider -m sanitize tests/test_layer_norm_cuda.py \
      tests/test_layer_norm_cuda_long_rows.py "$@"; then
    echo "== $tool: FAILED" >&2
    status=1
  fi
done
exit $status
