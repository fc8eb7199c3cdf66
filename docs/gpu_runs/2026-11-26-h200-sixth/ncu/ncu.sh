#!/usr/bin/env bash
# Nsight Compute on the 16-bit LayerNorm forward against add_layer_norm's (item 1 of the GPU list).
set -u
S=$1; T=$2
G=/tmp/gpu; mkdir -p $G
SOURCE_COMMIT=$S SOURCE_TREE=$T PHASES="build" DEADLINE_S=200 bash scripts/gpu_check.sh $G > $G/gpu_check.out 2>&1
echo "build rc $? at ${SECONDS}s" | tee -a $G/times.txt
export PYTHONPATH=$PWD
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU" >> $G/times.txt
for c in "bf16 ln 65536 1024" "bf16 add 65536 1024" "fp32 ln 65536 1024" "bf16 ln 87382 768"; do
  tag=${c// /_}
  timeout 60 $NCU --clock-control none --kernel-name regex:layer_norm_fwd_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters \
    python3 .gpu/ncu_case.py $c > $OUT/ncu_$tag.txt 2>&1
  echo "rc $? at ${SECONDS}s: $c" >> $G/times.txt
done
cp $G/times.txt $G/summary.md $OUT/; tail -n 5 $G/build.log > $OUT/build_tail.txt
cat $G/times.txt
