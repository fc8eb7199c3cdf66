#!/usr/bin/env bash
# The one device call of a lent GPU (issue 41: 15 minutes of device time, machine start
# included): about 9 minutes of work, results packed into ONE archive (the device tool brings
# back few files, two folders deep). docs/gpu_runs/README.md says how to call it.
#
#   1. build fusednorm for the visible GPU (scripts/gpu_check.sh's build phase, ~4 min);
#   2. with AB_QUESTIONS, the A/B variants' build (python -m benchmarks.cuda_ab build, CPU
#      only) in the background, beside
#   3. the CUDA and SASS tests (gpu_check.sh's test phase, -k "cuda or sass": the fuzz,
#      tests/test_fuzz.py, included; ~3 min alone);
#   4. with AB_QUESTIONS, the A/B sweep (python -m benchmarks.cuda_ab run): each variant
#      against base and the copy, its files rewritten after each case;
#   5. with SASS_FIGURES=1, the SASS figures of this build (python -m benchmarks.sass_figures;
#      about 70 s; a CPU build's figures match the device's: ninth run);
#   6. default benchmark suites with --save (BENCH_SUITES: the ones still unmeasured), the
#      files they wrote under benchmarks/results/ copied into the archive (results/).
#
#   bash scripts/gpu_session.sh     results in gpu_session_results/session/, packed into
#                                   $OUT/gpu_session.tar.gz (no $OUT: beside the folder)
#   DEADLINE_S=540          seconds in all (default 540); each step runs under the time left
#   AB_QUESTIONS=a,b        questions of the sweep ("all": every one of
#                           benchmarks/cuda_ab/variants.py; default none: their build beside
#                           the tests cut the tests at 240 s on the H200)
#   AB_PREBUILT=FILE        a pack of the questions' libraries made without a GPU
#                           (python -m benchmarks.cuda_ab pack; carried): step 2 then
#                           compiles only variants whose sources differ from the pack's
#   AB_ARGS="--n 4096,16384 --rounds 5"   more options for the sweep
#   AB_SECONDS=180          the sweep's time at most (it writes its files after each case)
#   BENCH_SUITES=layer_norm   the suites saved (empty: none)
#   SASS_FIGURES=1          step 5
#   SOURCE_COMMIT, SOURCE_TREE   stamp results with that commit when the files make that tree
#                           (scripts/source_commit.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_call.sh
source scripts/device_call.sh session
# The suites still to measure at the newest csrc/, in order: each is saved as it finishes,
# and the one the deadline cuts saves nothing; the rest go to a second call
# (docs/gpu_runs/README.md).
BENCH_SUITES=${BENCH_SUITES-add_rms_norm,gelu_ffn,overhead,layer_norm,rms_norm,add_layer_norm}
AB_QUESTIONS=${AB_QUESTIONS-}
[[ $AB_QUESTIONS == all ]] && AB_QUESTIONS=$("$PYTHON" -c \
  "from benchmarks.cuda_ab.variants import QUESTIONS; print(','.join(QUESTIONS))")

log "start; commit ${FUSEDNORM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"

# 1. Build (gpu_check.sh: the system's compilers first, the error-path check, build_info).
t=$(left)
step build "$t" env DEADLINE_S="$t" PHASES=build bash scripts/gpu_check.sh "$DIR/check_build" ||
  { log "build failed: stopping"; exit 1; }

# 2 + 3. The variants compile (a job per source, at most 8 a variant) while the tests run.
if [[ -n $AB_QUESTIONS ]]; then
  timeout "$(left)" "$PYTHON" -m benchmarks.cuda_ab build --jobs 8 --questions "$AB_QUESTIONS" \
    ${AB_PREBUILT:+--prebuilt "$AB_PREBUILT"} > "$DIR/cuda_ab_build.log" 2>&1 &
  ab_build=$!
fi
# The tests get at most 4 minutes, leaving the rest theirs.
t=$(( $(left) < 240 ? $(left) : 240 ))
step tests "$t" env DEADLINE_S="$t" PHASES=tests PYTEST_WORKERS=${PYTEST_WORKERS:-14} \
  PYTEST_K="${PYTEST_K:-cuda or sass}" bash scripts/gpu_check.sh "$DIR/check_tests"
if [[ -n $AB_QUESTIONS ]]; then
  wait $ab_build
  log "cuda_ab build: exit $? ($(tail -n 1 "$DIR/cuda_ab_build.log"))"
  # 4. The sweep (builds nothing when step 2 finished), at most AB_SECONDS: the suites keep
  # the rest (a sweep cut short keeps the cases it timed).
  t=$(( $(left) < ${AB_SECONDS:-180} ? $(left) : ${AB_SECONDS:-180} ))
  # shellcheck disable=SC2086  # AB_ARGS is a list of options
  step cuda_ab "$t" "$PYTHON" -m benchmarks.cuda_ab run --out "$DIR/cuda_ab" \
    --questions "$AB_QUESTIONS" ${AB_ARGS:-}
fi

# 5. The static figures of this build (cuobjdump), when asked for.
if [[ ${SASS_FIGURES:-0} == 1 ]]; then
  step sass_figures "$(left)" "$PYTHON" -m benchmarks.sass_figures --out "$DIR/sass"
fi

# 6. Saved default suites, while time is left (--save takes no --stop-after: a suite cut by
# the deadline writes nothing; it runs only with 90 s or more left).
if [[ -n "$BENCH_SUITES" && $(left) -ge 90 ]]; then
  step bench "$(left)" "$PYTHON" -m benchmarks --device cuda --save --suites "$BENCH_SUITES"
  # The files the suites rewrote or added under benchmarks/results/, as they lie there.
  git status --porcelain --untracked-files=all -- benchmarks/results | cut -c4- |
    while read -r f; do mkdir -p "$DIR/results/$(dirname "$f")" && cp "$f" "$DIR/results/$f"; done
fi
log "done"
# The device tool's reply carries the end of the output: the steps, the tests, the sweep.
cat "$DIR/session.log" "$DIR/check_tests/summary.md" 2>/dev/null
tail -n 60 "$DIR/cuda_ab/cuda_ab.md" 2>/dev/null
