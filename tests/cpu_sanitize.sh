#!/usr/bin/env bash
# The CPU kernels and the ops' C++ under GCC's AddressSanitizer and UndefinedBehaviorSanitizer:
# builds a copy of this checkout's tracked files with FUSEDNORM_SANITIZE=address,undefined
# (CPU kernels only) and runs the kernel tests on it. Any report (a read or write outside
# an allocation, a use after free, signed overflow, a misaligned or null access, ...)
# ends the run with a nonzero exit, so a clean exit means none was seen.
#
#   bash tests/cpu_sanitize.sh                      the kernel tests below
#   bash tests/cpu_sanitize.sh tests/test_fuzz.py   other tests (arguments go to pytest)
#
# The SIMD level is the build's default unless FUSEDNORM_CPU_CAPABILITY says (give each
# level its own SANITIZE_TREE, e.g. build/sanitize-avx2, so that neither rebuilds all).
#
# SANITIZE_TREE: where the copy is built (default build/sanitize; kept, so a rerun compiles
# only what changed). The CUDA kernels are checked by tests/sanitize.sh (compute-sanitizer)
# on a GPU, and on the CPU by the emulator's own bounds checks (tests/emulation).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tree=${SANITIZE_TREE:-$PWD/build/sanitize}
mkdir -p "$tree"
tree=$(cd "$tree" && pwd)

# tar keeps the files' times, so ninja recompiles only the sources that changed since the
# last run; files no longer tracked are left behind but not compiled (setup.py globs csrc/).
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$tree"
# torch's build runs the `ninja` found on PATH: $PYTHON's folder first (an unactivated venv).
export PATH="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
echo "cpu_sanitize: building the sanitized CPU kernels in $tree" >&2
start=$(date +%s)
(cd "$tree" && FUSEDNORM_CPU_ONLY=1 FUSEDNORM_SANITIZE=address,undefined \
   "$PYTHON" setup.py build_ext --inplace >build.log 2>&1) ||
  { tail -50 "$tree/build.log"; exit 1; }
echo "cpu_sanitize: built in $(( $(date +%s) - start )) s" >&2

# The sanitized library needs the ASan runtime loaded before anything else (Python is not
# built with it). Leaks are not checked: Python and torch keep memory until exit by design.
# allocator_may_return_null: a test that asks for more memory than there is expects torch's
# RuntimeError, which ASan's allocator would otherwise turn into an abort.
asan=$(${CXX:-g++} -print-file-name=libasan.so)
[[ -e $asan ]] || { echo "cpu_sanitize: libasan.so not found (gcc's libasan)" >&2; exit 2; }
# libstdc++ too: a library loaded later (triton's) throws through ASan's __cxa_throw, which
# finds the real one only if libstdc++ was loaded when ASan started.
export LD_PRELOAD="$asan $(${CXX:-g++} -print-file-name=libstdc++.so)${LD_PRELOAD:+ $LD_PRELOAD}"
# Reports go to files (pytest's output capture would swallow those of an aborted test),
# printed below.
reports=$tree/sanitizer-reports
rm -rf "$reports" && mkdir -p "$reports"
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:log_path=$reports/asan:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:log_path=$reports/ubsan:${UBSAN_OPTIONS:-}"
export PYTHONPATH="$tree"
cd "$tree"
"$PYTHON" - <<EOF
import fusednorm, fusednorm._build_config as config
assert fusednorm.__file__.startswith("$tree"), fusednorm.__file__
assert config.BUILD_KNOBS["FUSEDNORM_SANITIZE"] == "address,undefined", config.BUILD_KNOBS
info = fusednorm.build_info()
assert info["cpu_kernels"] and info["fast_calls"], info
EOF
if [[ $# -eq 0 ]]; then
  # The kernel tests, and those that send bad or random arguments through the ops' checks.
  mapfile -t files < <(grep -v -e '^#' -e '^$' tests/kernel_tests.txt)
  set -- "${files[@]}" tests/test_fuzz.py tests/test_errors.py tests/test_arguments.py
fi
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider "$@" || status=$?
if compgen -G "$reports/*" >/dev/null; then
  for report in "$reports"/*; do echo "== $report" >&2; head -100 "$report" >&2; done
  echo "cpu_sanitize: the sanitizers reported the errors above" >&2
  exit 1
fi
echo "cpu_sanitize: no sanitizer report (pytest exit $status)" >&2
exit "$status"
