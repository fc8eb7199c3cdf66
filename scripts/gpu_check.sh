#!/usr/bin/env bash
# Everything a GPU machine has to confirm, in one command (aim: under 20 minutes on one
# H100 with 16 cores): builds fusednorm in place for the visible GPU with all cores (the
# system's gcc/g++ first), then runs the test suite (the CUDA cases run instead of
# skipping) beside tests/sanitize.sh (memcheck, racecheck, synccheck), then every
# benchmark suite alone, writes the results under the
# output folder and prints a short summary. Needs no package index: torch, setuptools,
# ninja and pytest (+ hypothesis) must already be installed in $PYTHON's environment.
#
#   bash scripts/gpu_check.sh [OUT_DIR]      default: $OUT if set, else gpu_check_results/
#   PHASES="build tests"  bash scripts/gpu_check.sh     a subset (build tests sanitize bench)
#   PHASES=profile bash scripts/gpu_check.sh   Nsight Compute on PROFILE_CASES (not in the
#                       default phases; needs a build: run it after one, about 10 s a case)
#   BENCH_ARGS="--quick"  bash scripts/gpu_check.sh     options for python -m benchmarks
#   PYTEST_K="cuda and not slow" bash scripts/gpu_check.sh   a -k filter for the test phase
#   PYTEST_ARGS="-x"      bash scripts/gpu_check.sh     more options for its pytest
#   PYTEST_WORKERS=14     bash scripts/gpu_check.sh     test processes (pytest-xdist; default 8)
#   SOURCE_COMMIT=sha SOURCE_TREE=tree bash scripts/gpu_check.sh   stamp results with sha (see below)
#   DEADLINE_S=540 bash scripts/gpu_check.sh   end within 540 s of the start: each phase runs
#                       under a timeout of the time left, the benchmarks start no case after
#                       it (--stop-after) and write the cases timed by then
#   KEEP_CC=1 bash scripts/gpu_check.sh   build with the environment's CC/CXX (by default the
#                       system's /usr/bin/gcc and g++ first: see the build phase)
#   PACK=$OUT/gpu_check.tar.gz bash scripts/gpu_check.sh   also pack the output folder into
#                       one archive at exit (for a device tool that brings back few files)
#
# In OUT_DIR: build.log, tests.log + tests.xml (JUnit), sanitize.log, bench.log with the
# benchmark results in bench/, profile/ (one ncu report a case), build_info.json,
# nvidia-smi.txt, summary.md. Exits non-zero
# if any phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

OUT_DIR=${1:-${OUT:-$REPO/gpu_check_results}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHON=${PYTHON:-python3}
PHASES=${PHASES:-build tests sanitize bench}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PATH="$CUDA_HOME/bin:$PATH"
SUMMARY="$OUT_DIR/summary.md"
status=0

# DEADLINE_S: seconds this script may take in all. left: seconds still left (at least 5).
left() { local l=$(( ${DEADLINE_S:-0} - SECONDS )); (( l < 5 )) && l=5; echo $l; }
limited() {  # runs "$@" under a timeout of the time left, when there is a deadline
  if [[ -n "${DEADLINE_S:-}" ]]; then timeout "$(left)" "$@"; else "$@"; fi
}
if [[ -n "${PACK:-}" ]]; then
  # A tool that brings back a few files from shallow folders loses bench/<device>/*.
  trap 'tar czf "$PACK" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && log "packed into $PACK"' EXIT
fi

log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
phase_result() {  # name, exit code, seconds, detail
  local verdict=passed
  [[ $2 -ne 0 ]] && verdict="FAILED (exit $2)" && status=1
  printf '| %s | %s | %ss | %s |\n' "$1" "$verdict" "$3" "$4" >> "$SUMMARY"
  log "$1: $verdict in $3 s ${4:+($4)}"
}
wants() { [[ " $PHASES " == *" $1 "* ]]; }

# The commit the results are stamped with. A copy of the sources sent to a GPU machine may
# carry an older .git than its files (seen on the lent H100: results said 4dd2170-dirty):
# SOURCE_COMMIT=<sha> SOURCE_TREE=<git rev-parse sha^{tree}> stamps sha when the files here
# make that very tree (git write-tree over the working files; build outputs are ignored).
if [[ -n "${SOURCE_COMMIT:-}" ]]; then
  if commit=$(bash scripts/source_commit.sh); then
    export FUSEDNORM_COMMIT=$commit
    log "sources are commit $commit (tree $SOURCE_TREE)"
  else
    log "stamping git's own view"
  fi
fi

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), commit ${FUSEDNORM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo
  echo "| phase | result | time | detail |"
  echo "|---|---|---|---|"
} > "$SUMMARY"
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed (see nvidia-smi.txt)"

# The visible GPUs' archs (e.g. "9.0"), from torch: the build compiles for exactly these.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST=$("$PYTHON" -c '
import torch
assert torch.cuda.is_available(), "no visible CUDA GPU"
print(" ".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))
') || { log "torch sees no CUDA GPU: nothing to check here"; exit 2; }
fi
export TORCH_CUDA_ARCH_LIST
log "archs $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs, CUDA_HOME=$CUDA_HOME, results in $OUT_DIR"

if wants build; then
  start=$SECONDS
  # The GPU machines' default compilers (/opt/gcc, 2026-11-24 and -26) build a library that
  # segfaults on its first error message; the system's (/usr/bin) build passed there
  # (2026-11-26). So the system's first, even where the environment names others in CC/CXX
  # (one machine named /opt/gcc there, 2026-11-26: the build segfaulted in the error-path
  # check), unless KEEP_CC=1; the environment's ones if that fails (a build costs 1-2
  # minutes of a lease counted in minutes).
  if [[ -z "${KEEP_CC:-}" && -x /usr/bin/gcc && -x /usr/bin/g++ && "${CXX:-}" != /usr/bin/g++ ]]; then
    env_cc=${CC-} env_cxx=${CXX-}
    export CC=/usr/bin/gcc CXX=/usr/bin/g++
    fallback=1
  fi
  limited "$PYTHON" setup.py build_ext --inplace > "$OUT_DIR/build.log" 2>&1
  code=$?
  [[ $code -eq 0 ]] && { "$PYTHON" scripts/check_error_path.py >> "$OUT_DIR/build.log" 2>&1 || code=$?; }
  if [[ $code -ne 0 && -n "${fallback:-}" ]]; then
    log "build or error path check failed with CXX=$CXX: rebuilding with the environment's compilers"
    unset CC CXX
    [[ -n "$env_cc" ]] && export CC=$env_cc
    [[ -n "$env_cxx" ]] && export CXX=$env_cxx
    rm -rf build
    limited "$PYTHON" setup.py build_ext --inplace >> "$OUT_DIR/build.log" 2>&1 &&
      "$PYTHON" scripts/check_error_path.py >> "$OUT_DIR/build.log" 2>&1
    code=$?
  fi
  if [[ $code -eq 0 ]]; then
    "$PYTHON" -c 'import json, fusednorm; info = fusednorm.build_info(); print(json.dumps(info)); assert info["cuda_kernels"], "built without CUDA kernels"' \
      > "$OUT_DIR/build_info.json" 2>> "$OUT_DIR/build.log" || code=$?
  fi
  phase_result build $code $((SECONDS - start)) "$(tail -c 300 "$OUT_DIR/build_info.json" 2>/dev/null | tr -d '\n')"
  if [[ $code -ne 0 ]]; then
    tail -n 30 "$OUT_DIR/build.log"
    log "build failed: stopping"
    cat "$SUMMARY"
    exit 1
  fi
fi

run_tests() {
  local start=$SECONDS code workers=()
  # The whole suite: CUDA cases run on the GPU, the emulation and SASS checks too; on
  # PYTEST_WORKERS processes where pytest-xdist is installed (serially it outlasts a
  # 10-minute call: 1500 tests took 6 min on 14 workers of an H100 machine). tests.log ends
  # with the 30 slowest, for planning a lease's minutes.
  if "$PYTHON" -c 'import xdist' 2>/dev/null; then workers=(-n "${PYTEST_WORKERS:-8}"); fi
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
  FUSEDNORM_REQUIRE_SASS=1 FUSEDNORM_REQUIRE_EMULATION=1 \
    limited "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --durations=30 "${workers[@]}" --continue-on-collection-errors --junitxml="$OUT_DIR/tests.xml" tests \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} > "$OUT_DIR/tests.log" 2>&1
  code=$?
  phase_result tests $code $((SECONDS - start)) \
    "$(grep -E 'passed|failed|error|no tests ran' "$OUT_DIR/tests.log" | tail -n 1)"
  return $code
}

run_sanitize() {
  local start=$SECONDS code detail
  TOOLS=${SANITIZE_TOOLS:-memcheck racecheck synccheck} PYTHON="$PYTHON" limited bash tests/sanitize.sh \
    > "$OUT_DIR/sanitize.log" 2>&1
  code=$?
  detail=$(grep -E '^== |ERROR SUMMARY|passed|failed' "$OUT_DIR/sanitize.log" | tr '\n' ' ' | tail -c 400)
  phase_result sanitize $code $((SECONDS - start)) "$detail"
  return $code
}

# The tests and the sanitizers time nothing, so they run side by side (about 2.5 minutes
# instead of 4 on an H200, 2026-11-26); the benchmarks run alone after them.
if wants tests && wants sanitize; then
  run_tests & tests_pid=$!
  run_sanitize & sanitize_pid=$!
  wait $tests_pid || status=1
  wait $sanitize_pid || status=1
elif wants tests; then
  run_tests || status=1
elif wants sanitize; then
  run_sanitize || status=1
fi

if wants bench; then
  start=$SECONDS
  stop_after=()
  # With a deadline: no case starts in its last 40 s (a case of the FFN suite takes up to
  # a minute in float32; the run still writes what it timed), unless BENCH_ARGS says when.
  if [[ -n "${DEADLINE_S:-}" && " ${BENCH_ARGS:-} " != *" --stop-after "* ]]; then
    stop_after=(--stop-after $(( $(left) > 45 ? $(left) - 40 : 5 )))
  fi
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  limited "$PYTHON" -m benchmarks --device cuda --out "$OUT_DIR/bench" "${stop_after[@]}" ${BENCH_ARGS:-} \
    > "$OUT_DIR/bench.log" 2>&1
  code=$?
  phase_result bench $code $((SECONDS - start)) "results in bench/ ($(ls "$OUT_DIR/bench" 2>/dev/null | tr '\n' ' '))"
fi

# Nsight Compute, one launch of each case's row kernel after two warm-up launches
# (benchmarks/ncu_case.py): where the forward's and the long rows' backward's time goes
# (stall reasons, issue, DRAM throughput, occupancy). Cases: "op pass dtype M N", ';'-separated.
PROFILE_CASES=${PROFILE_CASES:-"layer_norm fwd bf16 16384 4096;rms_norm fwd bf16 16384 4096;layer_norm fwd fp32 16384 4096;add_layer_norm fwd bf16 16384 4096;layer_norm bwd bf16 4096 16384;rms_norm bwd bf16 4096 16384"}
if wants profile; then
  start=$SECONDS
  code=0 done_cases=0
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu "$CUDA_HOME/bin/ncu" 2>/dev/null | head -n 1)
  if [[ -z "$NCU" ]]; then
    code=127
  else
    mkdir -p "$OUT_DIR/profile"
    IFS=';' read -ra cases <<< "$PROFILE_CASES"
    for c in "${cases[@]}"; do
      read -r op pass dtype M N <<< "$c"
      # --clock-control none: the clocks a benchmark runs at, not ncu's base clocks.
      limited "$NCU" --clock-control none --kernel-name "regex:norm_${pass}_kernel" \
        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section InstructionStats \
        "$PYTHON" -m benchmarks.ncu_case $c > "$OUT_DIR/profile/${c// /_}.txt" 2>&1 || code=$?
      done_cases=$((done_cases + 1))
    done
  fi
  phase_result profile $code $((SECONDS - start)) "${NCU:-no ncu found}: $done_cases cases in profile/"
fi

echo
cat "$SUMMARY"
exit $status
