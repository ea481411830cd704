#!/usr/bin/env bash
# issue 51's evidence call, after issue 50's (bash benchmarks/evidence_issue51.sh on the device; needs
# benchmarks/results/h200.json as evidence_issue50.sh left it, copied back into the checkout): the CUDA
# tests that script does not run, two shards at once, then the decode rows (run_device.sh suite-apart's
# two processes, 16L then the whole-cache model) alone. Results into $OUT/h200.json, logs in $OUT/logs.tgz.
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT; W=/tmp/w51; mkdir -p $W
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
python -m pip install -q --no-deps --no-build-isolation -e . > $W/pip.log 2>&1 || { tail $W/pip.log; exit 1; }
T0=$(date +%s); n=0
for shard in "tests/test_cuda_start_up.py tests/test_warm_start.py tests/test_benchmarks.py tests/test_backend_cpu.py" \
             "tests/test_graph_attention.py tests/test_moved_inputs.py tests/test_other_idioms.py tests/test_static_cache_idioms.py tests/test_eager_sdpa_backends.py"; do
  n=$((n + 1))
  ( timeout -s INT 250 python -m pytest -q -rs -m cuda -p no:cacheprovider --junitxml=$W/junit_$n.xml $shard > $W/ct_$n.log 2>&1 ) &
done
wait
echo "tests $(( $(date +%s) - T0 )) s"
R=benchmarks/results/h200.json
python -m benchmarks.record --previous $R --out $W/rt.json --junit $W/junit_*.xml --tests-selection \
  "-m cuda in the test files evidence_issue50.sh does not run: 2 processes at once" > $W/rec.log 2>&1 && R=$W/rt.json
cp $R $OUT/h200.json  # partial results survive the call's 600 s limit
for variants in "limit dynamo-floor" "piecewise piecewise-skip-guards"; do
  for model in 16L 16L-whole-cache; do
    left=$(( 570 - ($(date +%s) - T0) )); [ $left -gt 150 ] && left=150; [ $left -lt 30 ] && { echo "no time left for $model $variants"; continue; }
    timeout $left python -m benchmarks.suite --out $W/suite.json --variants $variants --models $model --rounds 3 \
      --pause 0.3 --settle 2 > $W/suite_$model.log 2>&1
    python -m benchmarks.record --previous $R --out $W/r.json --suite $W/suite.json > /dev/null 2>&1 && cp $W/r.json $W/rs.json && R=$W/rs.json
    cp $R $OUT/h200.json; echo "$model $variants $(( $(date +%s) - T0 )) s"
  done
done
echo "suite $(( $(date +%s) - T0 )) s"
cp $R $OUT/h200.json; tar czf $OUT/logs.tgz -C /tmp w51
for f in $W/ct_*.log; do echo "-- $f"; grep -E "passed|failed|FAILED|ERROR" $f | cut -c1-300 | tail -6; done
python -m benchmarks.plot $OUT/h200.json 2>/dev/null | tail -12
