#!/usr/bin/env bash
# issue 50's evidence call (bash benchmarks/evidence_issue50.sh on the device): hf first (timed alone), then correctness and memory side by side
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT; W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
python -m pip install -q --no-deps --no-build-isolation -e . > $W/pip.log 2>&1 || { tail $W/pip.log; exit 1; }
T0=$(date +%s); n=0
timeout 240 python -m benchmarks.hf_generate --out $W/hf.json --dtype bfloat16 --models gemma3-28L-1.5b \
  --variants eager piecewise-dynamic piecewise-static-second-call --batches 1 --tokens 48 > $W/hf.log 2>&1
echo "hf $(( $(date +%s) - T0 )) s"; grep '^{' $W/hf.log | cut -c1-330
for shard in "tests/test_cuda_live_server.py tests/test_cuda_engine.py tests/test_cuda_capture.py tests/test_cuda_neighbours.py" \
             "tests/test_cuda.py tests/test_cuda_full_graph.py tests/test_cuda_never_silently_wrong.py" \
             "tests/test_hf_generate.py tests/test_paged_attention.py"; do
  n=$((n + 1))
  ( timeout -s INT 280 python -m pytest -q -rs -m cuda -p no:cacheprovider --junitxml=$W/junit_$n.xml $shard > $W/ct_$n.log 2>&1 ) &
done
( timeout 280 python -m tests.fuzz --out $W/fuzz.json --device cuda --models 3 --steps 50 --replays 0 > $W/fuzz.log 2>&1 ) &
( timeout 280 python -m benchmarks.threads --out $W/threads.json --capture-modes --child-timeout 90 > $W/threads.log 2>&1 ) &
( timeout 270 python -m benchmarks.graph_memory --out $W/gm.json --child-timeout 130 > $W/gm.log 2>&1 ) &
( timeout 270 python -m benchmarks.graph_memory --out $W/gms.json --sweep --models engine hf --child-timeout 100 > $W/gms.log 2>&1;
  timeout 90 python -m benchmarks.graph_memory --out $W/gms_up.json --sweep --order ascending --models hf --child-timeout 80 > $W/gmu.log 2>&1 ) &
wait
echo "parallel done $(( $(date +%s) - T0 )) s"
python - <<'PY'
import json
a = json.load(open("/tmp/w/gms.json")) if __import__("os").path.exists("/tmp/w/gms.json") else {"graph_memory_sweep": []}
b = json.load(open("/tmp/w/gms_up.json")) if __import__("os").path.exists("/tmp/w/gms_up.json") else {"graph_memory_sweep": []}
json.dump({"graph_memory_sweep": a["graph_memory_sweep"] + b["graph_memory_sweep"]}, open("/tmp/w/gms_all.json", "w"), indent=1)
PY
R=benchmarks/results/h200.json
python -m benchmarks.record --previous $R --out $W/r0.json --junit $W/junit_*.xml --tests-selection \
  "-m cuda in test_cuda_live_server, _engine, _capture, _neighbours, test_cuda, _full_graph, _never_silently_wrong, test_hf_generate, test_paged_attention: 3 processes at once" \
  > $W/rec0.log 2>&1 && R=$W/r0.json
python -m benchmarks.record --previous $R --out $W/r0b.json --fuzz $W/fuzz.json > /dev/null 2>&1 && R=$W/r0b.json
python -m benchmarks.record --previous $R --out $W/r1.json --hf $W/hf.json > /dev/null 2>&1 && R=$W/r1.json
python -m benchmarks.record --previous $R --out $W/r2.json --threads $W/threads.json > /dev/null 2>&1 && R=$W/r2.json
python -m benchmarks.record --previous $R --out $W/r3.json --graph-memory $W/gm.json > /dev/null 2>&1 && R=$W/r3.json
python -m benchmarks.record --previous $R --out $W/r4.json --graph-memory $W/gms_all.json > /dev/null 2>&1 && R=$W/r4.json
cp $R $OUT/h200.json
tar czf $OUT/logs.tgz -C /tmp w
echo "== cuda tests + fuzz"; for f in $W/ct_*.log $W/fuzz.log; do echo "-- $f"; grep -v "^DEBUG" $f | grep -E "passed|failed|FAILED|ERROR|wrong|empty|Error" | cut -c1-300 | tail -8; done
python - <<'PY'
import json, os
r = json.load(open(os.path.join(os.environ.get("OUT", "/tmp/out"), "h200.json")))
print("tests", r.get("tests"))
f = r.get("fuzz", {}); print("fuzz", {k: v for k, v in f.items() if not isinstance(v, (list, dict))} if isinstance(f, dict) else str(f)[:400])
t = r.get("threads", {}); print("threads", {k: v for k, v in t.items() if k.startswith(("background", "concurrent", "failed", "code"))})
print("threads before", json.dumps(t.get("before"))[:900])
for row in r.get("graph_memory_estimate", []): print("gm", {k: row.get(k) for k in ("model", "error", "predicted_bytes", "measured_bytes", "from_sizes", "code_hash")}, str(row.get("error"))[:200])
for row in r.get("graph_memory_sweep", []): print("sweep", row.get("model"), row.get("order"), [(x["size"], round(x["pool"] / 2**20)) for x in row.get("sweep", [])][:6], round(row["sweep"][-1]["pool"] / 2**20) if row.get("sweep") else row.get("error", "")[:200])
for row in r.get("hf", []):
    if row.get("code_hash") == r.get("threads", {}).get("code_hash"): print("hf", row.get("model"), row.get("variant"), row.get("ms_per_token"), row.get("speedup_vs_eager"))
print("hf_second_call", [(x.get("model"), x.get("ms_per_token"), x.get("speedup_vs_eager")) for x in r.get("hf_second_call", [])])
PY
