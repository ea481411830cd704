#!/usr/bin/env bash
# Evidence call 1 of 3 (issues 50 and 51; bash benchmarks/evidence_hf.sh on the device, alone, ~450 s):
# the "hf" rows, each variant set in its own process, one after the other (nothing else on the GPU).
# Raw JSON and logs into $OUT; benchmarks/evidence_record.sh merges them here afterwards.
source "$(dirname "$0")/evidence_common.sh"  # $OUT, caches, gpu.txt, the package installed
T0=$(date +%s)
HF="python -m benchmarks.hf_generate --dtype bfloat16 --models gemma3-28L-1.5b --batches 1 --tokens 48"
timeout 300 $HF --out $OUT/hf_dynamic.json --variants eager piecewise-dynamic > $OUT/hf_dynamic.log 2>&1
echo "hf dynamic $(( $(date +%s) - T0 )) s"
timeout $(( 580 - ($(date +%s) - T0) )) $HF --out $OUT/hf_second.json --variants eager piecewise-static-second-call \
  > $OUT/hf_second.log 2>&1
echo "hf second call $(( $(date +%s) - T0 )) s"; cat $OUT/gpu.txt
grep -h '^{' $OUT/hf_dynamic.log $OUT/hf_second.log | cut -c1-330
