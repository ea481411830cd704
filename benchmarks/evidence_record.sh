#!/usr/bin/env bash
# Merge the three evidence calls' raw results (the folders their $OUT came back to) into
# benchmarks/results/<gpu>.json, here (no GPU needed): bash benchmarks/evidence_record.sh DIR...
# Each part is recorded once its file is there; a part that fails to record says so and stops.
for dir in "$@"; do
  if [ -f "$dir/raw.tgz" ]; then  # the evidence scripts bring their files back as one tarball (8 files at most)
    unpacked=$(mktemp -d); tar xzf "$dir/raw.tgz" -C "$unpacked" && cp "$dir/gpu.txt" "$unpacked/" && dir=$unpacked || exit 1
  fi
  gpu=$(cat "$dir/gpu.txt") || exit 1
  slug=$(python -c "import sys; from benchmarks.record import gpu_slug; print(gpu_slug(sys.argv[1]))" "$gpu") || exit 1
  R=benchmarks/results/$slug.json; T=$(mktemp)
  rec() { python -m benchmarks.record --previous "$R" --out "$T" "$@" > /dev/null && cp "$T" "$R" || { echo "record $* failed"; exit 1; }; }
  for f in hf_dynamic hf_second; do if [ -f "$dir/$f.json" ]; then rec --hf "$dir/$f.json"; fi; done
  if ls "$dir"/junit_*.xml > /dev/null 2>&1; then
    selection="-m cuda in every CUDA test file"; [ -f "$dir/tests_selection.txt" ] && selection=$(cat "$dir/tests_selection.txt")
    rec --junit "$dir"/junit_*.xml --tests-selection "$selection: $(ls "$dir"/junit_*.xml | wc -l) processes at once"
  fi
  if [ -f "$dir/fuzz.json" ]; then rec --fuzz "$dir/fuzz.json"; fi
  if [ -f "$dir/threads.json" ]; then rec --threads "$dir/threads.json"; fi
  if [ -f "$dir/gm.json" ]; then rec --graph-memory "$dir/gm.json"; fi
  if [ -f "$dir/gms.json" ]; then rec --graph-memory "$dir/gms.json"; fi
  if [ -f "$dir/paged_kernel.json" ]; then rec --paged-kernel "$dir/paged_kernel.json"; fi
  if [ -f "$dir/seed.json" ]; then rec --seed-workload "$dir/seed.json"; fi
  if [ -f "$dir/start_up.json" ]; then rec --start-up "$dir/start_up.json"; fi
  for f in "$dir"/suite_*.json; do if [ -f "$f" ]; then rec --suite "$f"; fi; done
  python - "$R" "$gpu" "$dir" <<'PY'  # a results file begun here names its GPU and torch (record.py sets them on the GPU only)
import glob, json, sys
path, gpu, folder = sys.argv[1:]
result = json.load(open(path))
result.setdefault("gpu", gpu)
for raw in sorted(glob.glob(f"{folder}/*.json")):
    torch_version = json.load(open(raw)).get("torch") if raw.endswith(("hf_dynamic.json", "hf_second.json")) else None
    if torch_version:
        result.setdefault("torch", torch_version)
json.dump(result, open(path, "w"), indent=1)
open(path, "a").write("\n")
PY
  echo "$dir -> $R"
done
