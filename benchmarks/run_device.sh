#!/usr/bin/env bash
# One device call: install, run every test (CUDA ones included), the decode and capture benchmarks,
# and write benchmarks/results/h200.json (plus logs) under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q -rs tests/ --junitxml="$OUT/pytest.xml" -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
python benchmarks/decode_step.py --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/decode.log" | grep -v Warning
python benchmarks/capture_cost.py --out "$OUT/capture.json" 2>&1 | tee "$OUT/capture.log" | grep -v Warning
python benchmarks/record.py --junit "$OUT/pytest.xml" --decode "$OUT/decode.json" --capture "$OUT/capture.json" \
  --out "$OUT/h200.json"
