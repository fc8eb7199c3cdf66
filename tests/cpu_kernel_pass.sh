#!/usr/bin/env bash
# The CPU kernels at another SIMD level: builds a copy of this checkout's tracked files with
# FUSEDNORM_CPU_ONLY=1 FUSEDNORM_CPU_CAPABILITY=<level> in a temporary folder and runs the
# kernel tests (tests/kernel_tests.txt) on it. CI runs it for the levels its own build did
# not take: AVX2 (CPUs without AVX-512) and default (at::vec's portable code: a wheel built
# for any x86-64 CPU, and CPUs other than x86's).
#
#   bash tests/cpu_kernel_pass.sh avx2|default|avx512 [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
level=${1:?usage: cpu_kernel_pass.sh avx2|default|avx512 [pytest arguments]}
shift
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$tree"
start=$(date +%s)
(cd "$tree" && FUSEDNORM_CPU_ONLY=1 FUSEDNORM_CPU_CAPABILITY=$level \
   "$PYTHON" setup.py build_ext --inplace >build.log 2>&1) ||
  { tail -50 "$tree/build.log"; exit 1; }
mapfile -t files < <(grep -v -e '^#' -e '^$' tests/kernel_tests.txt)
cd "$tree"
PYTHONPATH="$tree" "$PYTHON" - <<PY
import fusednorm
assert fusednorm.__file__.startswith("$tree"), fusednorm.__file__
assert fusednorm.build_info()["cpu_capability"] == "$level", fusednorm.build_info()
PY
PYTHONPATH="$tree" "$PYTHON" -m pytest -q -p no:cacheprovider "${files[@]}" "$@"
echo "cpu_kernel_pass: the $level build and its kernel tests finished in $(( $(date +%s) - start )) s"
