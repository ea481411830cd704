#!/usr/bin/env bash
# Evidence call 2 of 3 (issues 50 and 51; bash benchmarks/evidence_tests.sh on the device, ~450 s): every
# CUDA test file, the GPU fuzz, threads and graph memory, side by side (none of them is a timing).
# Raw JSON, JUnit XML and logs into $OUT; benchmarks/evidence_record.sh merges them here afterwards.
source "$(dirname "$0")/evidence_common.sh"  # $OUT, caches, gpu.txt, the package installed
T0=$(date +%s); n=0
for shard in "tests/test_cuda_live_server.py tests/test_cuda_engine.py tests/test_cuda_capture.py tests/test_cuda_neighbours.py" \
             "tests/test_cuda.py tests/test_cuda_full_graph.py tests/test_cuda_never_silently_wrong.py" \
             "tests/test_hf_generate.py tests/test_paged_attention.py" \
             "tests/test_cuda_start_up.py tests/test_warm_start.py tests/test_benchmarks.py tests/test_backend_cpu.py" \
             "tests/test_graph_attention.py tests/test_moved_inputs.py tests/test_other_idioms.py tests/test_static_cache_idioms.py tests/test_eager_sdpa_backends.py"; do
  n=$((n + 1))
  ( timeout -s INT 500 python -m pytest -q -rs -m cuda -p no:cacheprovider --junitxml=$OUT/junit_$n.xml $shard > $OUT/ct_$n.log 2>&1 ) &
done
( timeout 400 python -m tests.fuzz --out $OUT/fuzz.json --device cuda --models 3 --steps 50 --replays 0 > $OUT/fuzz.log 2>&1 ) &
( timeout 400 python -m benchmarks.threads --out $OUT/threads.json --capture-modes --child-timeout 120 > $OUT/threads.log 2>&1 ) &
( timeout 400 python -m benchmarks.graph_memory --out $OUT/gm.json --child-timeout 180 > $OUT/gm.log 2>&1 ) &
( timeout 300 python -m benchmarks.graph_memory --out $OUT/gms.json --sweep --models engine hf --child-timeout 140 > $OUT/gms.log 2>&1
  timeout 150 python -m benchmarks.graph_memory --out $OUT/gms.json --sweep --order ascending --models hf --child-timeout 140 > $OUT/gmu.log 2>&1 ) &
wait
echo "parallel done $(( $(date +%s) - T0 )) s"; cat $OUT/gpu.txt
for f in $OUT/ct_*.log $OUT/fuzz.log; do echo "-- $f"; grep -v "^DEBUG" $f | grep -E "passed|failed|FAILED|ERROR|wrong|empty" | cut -c1-300 | tail -6; done
grep -h '^{' $OUT/gm.log | cut -c1-400
python - <<'PY'
import json, os
out = os.environ["OUT"]
t = json.load(open(f"{out}/threads.json")) if os.path.exists(f"{out}/threads.json") else {}
t = t.get("threads", t)
print("threads", {k: v for k, v in t.items() if k.startswith(("background", "concurrent", "failed"))})
if os.path.exists(f"{out}/gms.json"):
    for row in json.load(open(f"{out}/gms.json"))["graph_memory_sweep"]:
        s = row.get("sweep", [])
        print("sweep", row.get("model"), row.get("order"), [(x["size"], round(x["pool"] / 2**20)) for x in s][:5],
              round(s[-1]["pool"] / 2**20) if s else row.get("error", "")[-300:], sum(x.get("failed_captures", 0) for x in s[-1:]))
PY
bundle_out
