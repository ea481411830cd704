#!/usr/bin/env bash
# Issue 66's device call (bash benchmarks/evidence_issue66.sh on the device, ~300 s): the engine's start-up
# routes ("startup": eager, Inductor cold, save, warm from the artifact in a fresh container), then the
# CUDA tests of saving and loading (a fresh process with empty caches: eager's tokens, no Triton compile).
# Raw JSON, JUnit XML and logs into $OUT as one tarball; benchmarks/evidence_record.sh merges them here.
source "$(dirname "$0")/evidence_common.sh"  # $OUT, caches, gpu.txt, the package installed
T0=$(date +%s)
RETURN=$OUT; OUT=/tmp/issue66; mkdir -p $OUT; cp $RETURN/gpu.txt $OUT/
save() { tar czf $RETURN/raw.tgz -C $OUT .; }
timeout ${STARTUP_SECONDS:-330} python -m benchmarks.start_up --out $OUT/start_up.json \
  --variants ${STARTUP_VARIANTS:-eager,inductor,save,warm} --requests 3 --child-timeout 150 > $OUT/start_up.log 2>&1
echo "start-up $(( $(date +%s) - T0 )) s"; save
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/start_up.json"))["startup"]:
    print({k: v for k, v in r.items() if not k.startswith("profile") and k != "caches"})
PY
left=$(( ${TOTAL_SECONDS:-560} - ($(date +%s) - T0) - 20 )); [ $left -gt 200 ] && left=200
K=${TESTS_K:-not served_first}  # serve-first's test waits for a worker's compile: not this issue's
echo "-m cuda -k '$K' in tests/test_cuda_start_up.py tests/test_warm_start.py" > $OUT/tests_selection.txt
[ $left -gt 30 ] && timeout -s INT $left python -m pytest -q -rs -m cuda -k "$K" -p no:cacheprovider --junitxml=$OUT/junit_1.xml \
  tests/test_cuda_start_up.py tests/test_warm_start.py > $OUT/ct_1.log 2>&1
echo "tests $(( $(date +%s) - T0 )) s"; save
grep -E "passed|failed|FAILED|Error" $OUT/ct_1.log | cut -c1-400 | tail -6
