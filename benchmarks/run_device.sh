#!/usr/bin/env bash
# Device runs, in parts that fit one call each (10 minutes), accumulating in results/<gpu>.json
# (h200.json on an H200, h100.json on an H100: record.gpu_slug):
#
#   bash benchmarks/run_device.sh tests [ARGS...]   # every test, CUDA ones included (ARGS go to pytest:
#                                                   #   -m cuda runs only the GPU tests, ~1.5 of ~4.5 min;
#                                                   #   exits non-zero if a test failed)
#   bash benchmarks/run_device.sh cuda-tests N [FUZZ ARGS...]  # the CUDA tests in N pytest processes at once
#                                                   #   (test ids dealt round-robin, each shard under
#                                                   #   SHARD_TIMEOUT), with the fuzz run (FUZZ ARGS) beside
#                                                   #   them when given: correctness only, nothing timed
#   bash benchmarks/run_device.sh capture           # capture_cost.py: capture time and pool memory
#   bash benchmarks/run_device.sh host [ARGS...]    # host_breakdown.py ARGS: where a step's host time goes
#   bash benchmarks/run_device.sh suite [ARGS...]   # suite.py ARGS (e.g. --models 16L --startup)
#   bash benchmarks/run_device.sh suite-apart [ARGS...]  # suite.py ARGS (no --variants) twice: limit and
#                                                   #   dynamo-floor in one process, piecewise in another
#                                                   #   (coresidence.py: the limit's build slows piecewise;
#                                                   #   PIECEWISE_VARIANTS="piecewise piecewise-skip-guards"
#                                                   #   times more variants in the second process)
#   bash benchmarks/run_device.sh fuzz [ARGS...]    # python -m tests.fuzz ARGS: random models vs eager, memory
#   bash benchmarks/run_device.sh hf [ARGS...]      # hf_generate.py ARGS: transformers generate() ms/token
#   bash benchmarks/run_device.sh kernel            # attention_kernel.py: the decode attention kernel vs SDPA
#   bash benchmarks/run_device.sh graph-kernels [ARGS...]  # graph_kernels.py ARGS: a step's kernels vs the limit's
#   bash benchmarks/run_device.sh threads [ARGS...] # threads.py ARGS: captures beside other threads, concurrent callers
#   bash benchmarks/run_device.sh weights           # moved_weights.py: re-capture vs un-graphed after new weights
#   bash benchmarks/run_device.sh serving [ARGS...] # serving.py ARGS: the serving engine, per variant and start
#   bash benchmarks/run_device.sh graph-memory [ARGS...]  # graph_memory.py ARGS: estimate_graph_memory against
#                                                   #   every size captured (engine, HF model); --sweep: per size
#   bash benchmarks/run_device.sh seed-workload [ARGS...]  # seed_workload.py ARGS: the seed's workload and the
#                                                   #   concurrency sweep, per variant (breakable-cuda-graphs
#                                                   #   needs its wheel carried in .whl/: installed here)
#   bash benchmarks/run_device.sh start-up [ARGS...]  # start_up.py ARGS: the engine's start-up routes (eager,
#                                                   #   Inductor, no Inductor, saved/loaded, serve-first), each cold
#   bash benchmarks/run_device.sh entry [ARGS...]   # dynamo_entry.py ARGS: Dynamo's per-call cost, guard filters
#   bash benchmarks/run_device.sh serve-first-sweep  # serve-first per worker count and pre-started (not recorded)
#   bash benchmarks/run_device.sh hf-startup [ARGS...]  # hf_startup.py ARGS: first generate() cold, warm, new shapes
#   bash benchmarks/run_device.sh tp-tests          # two GPUs: tests/test_tensor_parallel.py (torchrun + NCCL too)
#   bash benchmarks/run_device.sh tp-hf [ARGS...]   # two GPUs: hf_tensor_parallel.py ARGS, fp32 tokens then bf16 ms
#                                                   #   (both in results/h200x2_tensor_parallel.json)
#   bash benchmarks/run_device.sh ab A_DIR B_DIR [ARGS...]  # ab_versions.py: two package versions, alternated
#                                                   #   ($OUT/ab_versions.json; not merged into the results)
#
# Each part merges its keys into the repo's benchmarks/results/<gpu>.json (stamped with the code hash)
# and leaves the result, logs and the figure under $OUT; copy $OUT/<gpu>.json back into the repo.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Inductor's and Triton's caches in the checkout's ignored .cache/: the device keeps ignored files
# between calls while the machine stays warm, so the next part loads what this one compiled (a 16L
# variant: ~25 s to compile, a few to load). Rows say which they timed (inductor_compiled,
# inductor_cache_hits); the start-up rows always use fresh caches of their own.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
# one results file per kind of GPU: the machines lent differ from call to call, and a ratio is only
# quoted between rows of one GPU
GPU=$(python -c "from benchmarks import record; print(record.gpu_slug())") || exit 1
RESULTS=benchmarks/results/$GPU.json
TP_RESULTS=benchmarks/results/h200x2_tensor_parallel.json  # the two-GPU parts' (tp-tests, tp-hf)
RECORDED=$OUT/$GPU.json
part=${1:-tests}
shift || true
record() {
  python -m benchmarks.record "$@" --previous "$RESULTS" --out "$RECORDED" && cp "$RECORDED" "$RESULTS"
}
case "$part" in
  tests)
    python -m pytest -q -rs tests/ --junitxml="$OUT/pytest.xml" -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" \
      | tail -25
    record --junit "$OUT/pytest.xml"
    # a failed test fails the part, so `run_device.sh tests -m cuda && run_device.sh suite ...` stops
    python -c "import json, sys; sys.exit(json.load(open('$RECORDED'))['tests']['failed'] > 0)" ;;
  cuda-tests)
    # $OUT brings back at most 8 files: the shards' own files stay in $work, their logs come back as one
    shards=${1:-4}; shift || true
    work=$(mktemp -d)
    python -m pytest -q --collect-only -m cuda tests/ -p no:cacheprovider 2>/dev/null | grep '::' >"$work/ids.txt"
    echo "$(wc -l <"$work/ids.txt") CUDA tests in $shards shards"
    for i in $(seq 0 $((shards - 1))); do
      awk -v n="$shards" -v i="$i" 'NR % n == i' "$work/ids.txt" >"$work/ids_$i.txt"
      (xargs -a "$work/ids_$i.txt" -d '\n' timeout -s INT "${SHARD_TIMEOUT:-420}" python -m pytest -q -rs \
        -p no:cacheprovider --junitxml="$work/pytest_$i.xml" >"$work/pytest_$i.log" 2>&1; tail -3 "$work/pytest_$i.log") &
    done
    if [ $# -gt 0 ]; then
      (timeout "${SHARD_TIMEOUT:-420}" python -m tests.fuzz --out "$OUT/fuzz.json" "$@" >"$OUT/fuzz.log" 2>&1;
       grep -v Warning "$OUT/fuzz.log" | tail -8) &
    fi
    wait
    for i in $(seq 0 $((shards - 1))); do echo "=== shard $i"; cat "$work/pytest_$i.log"; done >"$OUT/pytest.log"
    grep -h -E "^(FAILED|ERROR)" "$OUT/pytest.log"
    record --junit "$work"/pytest_*.xml --tests-selection "-m cuda, $shards shards at once" \
      --tests-collected "$(wc -l <"$work/ids.txt")"
    [ -f "$OUT/fuzz.json" ] && record --fuzz "$OUT/fuzz.json"
    python -c "import json, sys; t = json.load(open('$RECORDED'))['tests']; sys.exit(t['failed'] + t['not_run'] > 0)" ;;
  capture)
    python -m benchmarks.capture_cost --out "$OUT/capture.json" 2>&1 | tee "$OUT/capture.log" | grep -v Warning
    record --capture "$OUT/capture.json" ;;
  host)
    python -m benchmarks.host_breakdown --json "$OUT/host.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/host.log"
    record --host "$OUT/host.json" ;;
  suite)
    # the suite saves each row as it goes: a run cut short by the timeout still records what it measured
    timeout "${SUITE_TIMEOUT:-540}" python -m benchmarks.suite --out "$OUT/suite.json" "$@" 2>&1 \
      | tee "$OUT/suite.log" | grep '^{'
    record --suite "$OUT/suite.json"
    python -m benchmarks.plot "$RECORDED" --png "$OUT/${GPU}_decode.png" ;;
  suite-apart)
    # each side in a process of its own; record.py merges rows of one code hash, and a piecewise row,
    # with no limit in its process, is divided by its model's and batch's limit row (plot.vs_limit)
    for variants in "limit dynamo-floor" "${PIECEWISE_VARIANTS:-piecewise}"; do
      timeout "${SUITE_TIMEOUT:-270}" python -m benchmarks.suite --out "$OUT/suite.json" --variants $variants "$@" 2>&1 \
        | tee -a "$OUT/suite.log" | grep '^{'
      record --suite "$OUT/suite.json"
    done
    python -m benchmarks.plot "$RECORDED" --png "$OUT/${GPU}_decode.png" ;;
  fuzz)
    python -m tests.fuzz --out "$OUT/fuzz.json" "$@" 2>&1 | tee "$OUT/fuzz.log" | grep -v Warning | tail -30
    record --fuzz "$OUT/fuzz.json" ;;
  weights)
    python -m benchmarks.moved_weights --out "$OUT/moved_weights.json" "$@" 2>&1 | tail -3
    record --moved-weights "$OUT/moved_weights.json" ;;
  hf)
    timeout "${SUITE_TIMEOUT:-540}" python -m benchmarks.hf_generate --out "$OUT/hf.json" "$@" 2>&1 \
      | tee "$OUT/hf.log" | grep '^{'
    record --hf "$OUT/hf.json" ;;
  threads)
    timeout "${SUITE_TIMEOUT:-540}" python -m benchmarks.threads --out "$OUT/threads.json" "$@" 2>&1 \
      | tee "$OUT/threads.log" | grep '^{'
    record --threads "$OUT/threads.json" ;;
  serving)
    timeout "${SUITE_TIMEOUT:-560}" python -m benchmarks.serving --out "$OUT/serving.json" "$@" 2>&1 \
      | tee "$OUT/serving.log" | grep '^{'
    record --serving "$OUT/serving.json"
    python -m benchmarks.serving --out "$OUT/serving.json" --figure "$OUT/serving_itl.png" ;;
  graph-memory)
    timeout "${SUITE_TIMEOUT:-540}" python -m benchmarks.graph_memory --out "$OUT/graph_memory.json" "$@" 2>&1 \
      | tee "$OUT/graph_memory.log" | grep '^{' | cut -c1-600
    record --graph-memory "$OUT/graph_memory.json" ;;
  seed-workload)
    ls .whl/breakable_cuda_graphs-*.whl >/dev/null 2>&1 && python -m pip install -q --no-deps .whl/breakable_cuda_graphs-*.whl
    timeout "${SUITE_TIMEOUT:-560}" python -m benchmarks.seed_workload --out "$OUT/seed_workload.json" "$@" 2>&1 \
      | tee "$OUT/seed_workload.log" | grep '^{"variant'
    record --seed-workload "$OUT/seed_workload.json"
    python -m benchmarks.seed_workload --out "$RECORDED" --figure "$OUT/seed_tpot.png" ;;
  start-up)
    ls .whl/breakable_cuda_graphs-*.whl >/dev/null 2>&1 && python -m pip install -q --no-deps .whl/breakable_cuda_graphs-*.whl
    timeout "${SUITE_TIMEOUT:-560}" python -m benchmarks.start_up --out "$OUT/start_up.json" "$@" 2>&1 \
      | tee "$OUT/start_up.log" | grep '^{"variant'
    record --start-up "$OUT/start_up.json" ;;
  serve-first-sweep)
    # serve-first per worker count (PIECEWISE_COMPILE_WORKERS; "" = the default) and started with the
    # process, beside eager and Inductor cold: $OUT/sweep_<variant>_<workers>.json, not recorded
    timeout 100 python -m benchmarks.start_up --out "$OUT/sweep_reference.json" --variants eager,inductor "$@" \
      2>&1 | grep '^{"variant'
    for run in "serve-first 1" "serve-first 2" "serve-first-prestarted " "serve-first-prestarted 1"; do
      set -- $run
      PIECEWISE_COMPILE_WORKERS=${2:-} timeout 120 python -m benchmarks.start_up --out "$OUT/sweep_$1_${2:-default}.json" \
        --variants "$1" --child-timeout 110 --switch-timeout 80 2>&1 | grep '^{"variant'
    done ;;
  hf-startup)
    timeout "${SUITE_TIMEOUT:-560}" python -m benchmarks.hf_startup --out "$OUT/hf_startup.json" "$@" 2>&1 \
      | tee "$OUT/hf_startup.log" | grep '^{'
    record --hf-startup "$OUT/hf_startup.json" ;;
  entry)
    python -m benchmarks.dynamo_entry --out "$OUT/entry.json" "$@" 2>&1 | grep '^{'
    record --entry "$OUT/entry.json" ;;
  kernel)
    python -m benchmarks.attention_kernel --json "$OUT/kernel.json" 2>&1 | grep -v Warning | tee "$OUT/kernel.log"
    record --kernel "$OUT/kernel.json" ;;
  graph-kernels)
    timeout "${SUITE_TIMEOUT:-540}" python -m benchmarks.graph_kernels --json "$OUT/graph_kernels.json" "$@" \
      2>&1 | grep -v Warning | tee "$OUT/graph_kernels.log"
    record --graph-kernels "$OUT/graph_kernels.json" ;;
  tp-tests)
    # two GPUs (nvidia-h200-x2): the tensor-parallel tests, the torchrun + NCCL one included
    python -m pytest -q -rs tests/test_tensor_parallel.py --junitxml="$OUT/tp_pytest.xml" -p no:cacheprovider 2>&1 \
      | tail -5
    python -m benchmarks.record_tensor_parallel --junit "$OUT/tp_pytest.xml" --previous "$TP_RESULTS" \
      --out "$OUT/h200x2_tensor_parallel.json" && cp "$OUT/h200x2_tensor_parallel.json" "$TP_RESULTS" ;;
  tp-hf)
    # two GPUs: a Hugging Face model under tp_plan="auto" (ARGS, e.g. --model/--batches, go to both runs):
    # fp32 first (eager and piecewise-static: tokens against one process), then bf16 (TP_VARIANTS: ms per
    # token, with the fp32 run's agreement); each run under SUITE_TIMEOUT, its rows written as they come
    tp_run() { timeout "${SUITE_TIMEOUT:-270}" torchrun --standalone --nproc-per-node 2 \
      -m benchmarks.hf_tensor_parallel "$@" 2>&1 | tee -a "$OUT/tp_hf.log" | grep '^{'; }
    tp_run --out "$OUT/tp_fp32.json" --dtype float32 --variants eager piecewise-static "$@"
    # shellcheck disable=SC2086  # TP_VARIANTS: several words
    tp_run --out "$OUT/tp_bf16.json" --dtype bfloat16 --agreement-from "$OUT/tp_fp32.json" "$@" \
      --variants ${TP_VARIANTS:-eager piecewise-static piecewise-dynamic compile-default}
    python -m benchmarks.record_tensor_parallel --hf "$OUT/tp_bf16.json" --previous "$TP_RESULTS" \
      --out "$OUT/h200x2_tensor_parallel.json" && cp "$OUT/h200x2_tensor_parallel.json" "$TP_RESULTS" ;;
  ab)
    python -m benchmarks.ab_versions --json "$OUT/ab_versions.json" "$@" 2>&1 | tee "$OUT/ab.log" | grep '^{"model' ;;
  *) echo "unknown part $part: tests, cuda-tests, capture, host, suite, suite-apart, fuzz, weights, hf, serving, seed-workload, start-up, entry, hf-startup, kernel, graph-kernels, threads, tp-tests, tp-hf or ab" >&2; exit 2 ;;
esac
