#!/usr/bin/env bash
# Issue 65's device call (bash benchmarks/evidence_issue65.sh on the device, ~560 s): the kernel against flash
# SDPA and the byte floor ("paged_kernel"), the seed workload and the concurrency sweep ("seed_workload",
# "concurrency"), the paged kernel's and the engine's CUDA tests, then in what is left the kernel's other
# launches (printed); one after the other, so that nothing else runs beside a timing; each step's timeout
# keeps the whole under TOTAL_SECONDS. SEED_VARIANTS, SEED_ARGS change what runs. Raw JSON, JUnit XML and
# logs into $OUT as one tarball; benchmarks/evidence_record.sh merges them here afterwards.
source "$(dirname "$0")/evidence_common.sh"  # $OUT, caches, gpu.txt, the package installed
T0=$(date +%s); n=0
# the work in a folder of its own, tarred into $OUT after each step: a call cut short still brings back
# what was measured (a call returns 8 files at most)
RETURN=$OUT; OUT=/tmp/issue65; mkdir -p $OUT; cp $RETURN/gpu.txt $OUT/
save() { tar czf $RETURN/raw.tgz -C $OUT .; }
# first, one call of the kernel against the reference: a kernel that does not compile stops the call here
python - <<'PY' || { echo "the paged kernel failed: nothing else run"; exit 1; }
import torch
from piecewise_backend.ops import paged_decode_attention
from piecewise_backend.ops.paged_attention import reference_decode_attention
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(64, 12, 128, device="cuda", dtype=dtype)
    k, v = torch.randn(2, 64 * 70, 16, 2, 128, device="cuda", dtype=dtype).unbind(0)
    tables = torch.randperm(64 * 70, device="cuda").view(64, 70).int()
    lens = torch.randint(0, 1100, (64,), device="cuda")
    want = reference_decode_attention(q.float(), k.float(), v.float(), tables, lens, 128**-0.5)
    torch.testing.assert_close(paged_decode_attention(q, k, v, tables, lens).float(), want, atol=2e-2, rtol=2e-2)
print("paged kernel ok")
PY
timeout ${KERNEL_SECONDS:-120} python -m benchmarks.paged_kernel --out $OUT/paged_kernel.json  \
  > $OUT/paged_kernel.log 2>&1
echo "kernel $(( $(date +%s) - T0 )) s"; save
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/paged_kernel.json"))["paged_kernel"]:
    print({k: r[k] for k in ("B", "context", "paged_us", "sdpa_us", "sdpa_default_us", "floor_us", "vs_sdpa", "vs_floor")})
    if "variants_us" in r:
        print("   ", r["variants_us"])
PY
timeout ${SEED_SECONDS:-300} python -m benchmarks.seed_workload --out $OUT/seed.json \
  --variants ${SEED_VARIANTS:-full-and-piecewise,piecewise} --child-timeout 210 ${SEED_ARGS:-} > $OUT/seed.log 2>&1
echo "seed $(( $(date +%s) - T0 )) s"; cat $OUT/gpu.txt; save
grep -h '^{' $OUT/seed.log | cut -c1-700
SHARDS=("tests/test_paged_attention.py" "tests/test_cuda_full_graph.py tests/test_cuda_engine.py")
[ -n "${SKIP_TESTS:-}" ] && SHARDS=()  # a short call: the timings alone
echo "-m cuda in ${SHARDS[*]}" > $OUT/tests_selection.txt
for shard in "${SHARDS[@]}"; do
  n=$((n + 1))
  left=$(( ${TOTAL_SECONDS:-560} - ($(date +%s) - T0) - 30 )); [ $left -gt 200 ] && left=200
  ( timeout -s INT $left python -m pytest -q -rs -m cuda -p no:cacheprovider --junitxml=$OUT/junit_$n.xml \
      $shard > $OUT/ct_$n.log 2>&1 ) &
done
wait
echo "tests $(( $(date +%s) - T0 )) s"; save
for f in $OUT/ct_*.log; do grep -E "passed|failed|FAILED|Error" $f | cut -c1-300 | tail -4; done
left=$(( ${TOTAL_SECONDS:-560} - ($(date +%s) - T0) ))  # what is left: the kernel's other launches (printed, not recorded)
[ $left -gt 40 ] && timeout $left python -m benchmarks.paged_kernel --out $OUT/paged_kernel_variants.json --variants \
  --batches ${VARIANT_BATCHES:-1,8,64,128} --contexts 1000 > $OUT/variants.log 2>&1
python - <<'PY'
import json, os
path = os.environ["OUT"] + "/paged_kernel_variants.json"
for r in json.load(open(path))["paged_kernel"] if os.path.exists(path) else []:
    print(r["B"], r["context"], r.get("variants_us"))
PY
save
