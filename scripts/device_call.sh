# Sourced by the device-call scripts (gpu_session.sh, gpu_training.sh) with their name, e.g.
# `source scripts/device_call.sh session`: the results folder gpu_<name>_results/<name>/
# (in the tree, ignored) packed into ONE archive, $OUT/gpu_<name>.tar.gz, when the script
# exits (the device tool brings back few files, two folders deep); DEADLINE_S seconds in all
# and the helpers that keep each step under the time left; results stamped with
# SOURCE_COMMIT when the files make SOURCE_TREE (scripts/source_commit.sh).
name=$1
DIR=$PWD/gpu_${name}_results/$name
ARCHIVE=${OUT:-$PWD/gpu_${name}_results}/gpu_$name.tar.gz
rm -rf "$DIR" && mkdir -p "$DIR" "$(dirname "$ARCHIVE")"
PYTHON=${PYTHON:-python3}
export DEADLINE_S=${DEADLINE_S:-540}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
# shellcheck disable=SC2064  # expanded now, on purpose
trap "tar czf '$ARCHIVE' -C '$(dirname "$DIR")' '$name' && echo 'packed $ARCHIVE'" EXIT

log() { echo "[gpu_$name $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$DIR/session.log"; }
left() { local l=$((DEADLINE_S - SECONDS)); ((l < 5)) && l=5; echo $l; }
step() {  # name, seconds, command...: runs it under that limit, logs to <name>.log
  local step_name=$1 limit=$2 start=$SECONDS code
  shift 2
  timeout "$limit" "$@" > "$DIR/$step_name.log" 2>&1
  code=$?
  log "$step_name: exit $code in $((SECONDS - start)) s"
  return $code
}

if [[ -n "${SOURCE_COMMIT:-}" ]] && commit=$(bash scripts/source_commit.sh); then
  export FUSEDNORM_COMMIT=$commit
fi
