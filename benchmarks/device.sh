#!/usr/bin/env bash
# On the lent GPU machine, from the repository root: install the package, then run each argument
# "SECONDS SUITE [options]" as `python -m benchmarks SUITE [options]` under that many seconds, its
# rows appended to $OUT/rows.jsonl as they come (`python -m benchmarks record` files them here).
#   bash benchmarks/device.sh "120 kernels" "300 serving --timeout 280"
# A carried .whl/ folder (newer wheels, e.g. transformers) is installed into /tmp/site, which only
# runs prefixed "WHEELS" see:  "560 WHEELS reliability --variants cuda-tests --tests tests/test_hf_generate.py --tests-procs 3"
export OUT=${OUT:-/tmp/out} PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor TRITON_CACHE_DIR=$PWD/.cache/triton
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
if [ -d .whl ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
T0=$(date +%s)
for run in "$@"; do
  read -r seconds rest <<< "$run"
  env=()
  if [[ $rest == WHEELS* ]]; then rest=${rest#WHEELS }; env=(PYTHONPATH=/tmp/site); fi
  echo "== $rest ($seconds s at most, $(( $(date +%s) - T0 )) s in)"
  eval "args=($rest)"  # quotes in an argument hold (--tests-k 'not slow')
  env "${env[@]}" timeout "$seconds" python -m benchmarks "${args[@]}" --out "$OUT/rows.jsonl" 2>> "$OUT/stderr.log" \
    | cut -c1-400
done
echo "== done in $(( $(date +%s) - T0 )) s"; tail -3 "$OUT/stderr.log" | cut -c1-300
