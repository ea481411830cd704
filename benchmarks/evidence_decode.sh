#!/usr/bin/env bash
# Evidence call 3 of 3 (issue 51; bash benchmarks/evidence_decode.sh on the device, alone, ~570 s): the
# decode rows (run_device.sh suite-apart's two processes), 16L then the whole-cache model, each run given
# an equal share of what is left (DECODE_SECONDS in all; DECODE_MODELS, DECODE_ROUNDS). Raw JSON per
# run into $OUT, brought back as one tarball; benchmarks/evidence_record.sh merges them.
source "$(dirname "$0")/evidence_common.sh"  # $OUT, caches, gpu.txt, the package installed
T0=$(date +%s); TOTAL=${DECODE_SECONDS:-570}; MODELS=${DECODE_MODELS:-16L 16L-whole-cache}
runs_left=$(( 2 * $(echo $MODELS | wc -w) ))
for variants in "limit dynamo-floor" "piecewise piecewise-skip-guards"; do
  for model in $MODELS; do
    left=$(( (TOTAL - ($(date +%s) - T0)) / runs_left )); runs_left=$(( runs_left - 1 ))  # an equal share of what is left
    [ $left -gt 150 ] && left=150; [ $left -lt 30 ] && { echo "no time left for $model $variants"; continue; }
    name=suite_${model}_${variants%% *}
    timeout $left python -m benchmarks.suite --out $OUT/$name.json --variants $variants --models $model --rounds ${DECODE_ROUNDS:-3} \
      --pause 0.3 --settle 2 > $OUT/$name.log 2>&1
    echo "$model $variants $(( $(date +%s) - T0 )) s"
  done
done
cat $OUT/gpu.txt; grep -h '^{' $OUT/suite_*.log | cut -c1-200
bundle_out
