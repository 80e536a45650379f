#!/usr/bin/env bash
# The CUDA checks and figures, on a machine with an NVIDIA GPU and PyTorch 2.11 (whose libtorch the
# binaries load) but no Rust toolchain: binaries built elsewhere against the same torch version
# (scripts/setup.sh installs it) run here with LD_LIBRARY_PATH on this machine's torch/lib.
#
#   bench/cuda.sh BIN_DIR MODEL.gguf OUT_DIR [CLIENTS...]
#
# BIN_DIR holds rivulet-scheduler, rivulet-worker, rivulet-bench, rivulet-worker-bench and the
# CUDA test binary (`cuda-*`, from `cargo test --release -p rivulet-worker --test cuda --no-run`),
# and optionally the worker's unit-test binary (`rivulet_worker-*`, from `cargo test --release -p
# rivulet-worker --lib --no-run`), whose `_on_cuda` tests then run too (the libtorch sampler on
# the GPU against the CPU kernels' rows).
# Runs, in order: the tests (bf16 on the GPU against f32 on the CPU), the worker bench on cuda:0
# (decode batches 1, 32, 256, 1024 at context 256), then rivulet-bench through a scheduler with one
# worker on cuda:0 at each client count (default 1 32 256 1024; 128-token random prompts, 128
# greedy tokens, ignore_eos), with the scheduler's own step timings. Figures land in OUT_DIR.
# The serving runs go once per configuration: `worker.cuda_graphs` off ("eager"), on with decode
# attention gathering its KV blocks ("gathered"), and on with the paged kernel ("graphs"). Binaries of another build placed
# beside them with the suffix `-before` (rivulet-scheduler-before, rivulet-worker-before,
# rivulet-worker-bench-before) are measured too, in the same run, for a side-by-side ratio (the
# "before" configuration: graphs on, each binary's `-before` build where there is one).
# CONFIGURATIONS="before graphs" (labels of the ones below) runs only those; ROUNDS=N runs the
# serving configurations N times, alternating; SERVING_ONLY=1 skips the tests and the worker bench.
set -uo pipefail
BIN="$(cd "$1" && pwd)"
MODEL="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
OUT="$3"
shift 3
CLIENTS=("$@")
[ ${#CLIENTS[@]} -eq 0 ] && CLIENTS=(1 32 256 1024)
mkdir -p "$OUT"

TORCH_LIB="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

if [ -z "${SERVING_ONLY:-}" ]; then
echo "== worker/tests/cuda.rs"
# The test looks for the model in its checkout; point it here instead.
(cd "$BIN" && RIVULET_TEST_MODEL="$MODEL" "$BIN"/cuda-* --nocapture 2>&1 | tee "$OUT/cuda_test.log")

for unit_tests in "$BIN"/rivulet_worker-*; do
    [ -x "$unit_tests" ] || continue
    echo "== $(basename "$unit_tests") on_cuda"
    "$unit_tests" on_cuda paged_attention --nocapture 2>&1 | tee -a "$OUT/cuda_test.log"
done

# The current bench twice: decode attention gathering its KV blocks, then through the paged kernel.
for run in rivulet-worker-bench-before: rivulet-worker-bench:RIVULET_KERNELS_NO_CUDA_PAGED_ATTENTION=1 rivulet-worker-bench:; do
    bench=${run%%:*} variable=${run#*:}
    [ -x "$BIN/$bench" ] || continue
    echo "== $bench on cuda:0 $variable"
    env ${variable:+"$variable"} RIVULET_BENCH_DEVICE=cuda:0 RIVULET_BENCH_CONTEXT=256 RIVULET_BENCH_BATCHES=1,32,256,1024 \
        "$BIN/$bench" "$MODEL" 2>&1 | tee -a "$OUT/worker_bench.log"
done

fi

echo "== rivulet-bench through rivulet-scheduler, one worker on cuda:0"
export RIVULET_MODEL__PATH="$MODEL"
export RIVULET_WORKER__DEVICE=cuda:0
export RIVULET_WORKER__KV_CACHE_MEMORY_FRACTION=0.5
export RIVULET_SCHEDULER__MAX_NUM_SEQS=1024
export RIVULET_SCHEDULER__MAX_NUM_BATCHED_TOKENS=8192
export RIVULET_SCHEDULER__MAX_QUEUED_REQUESTS=4096
# serve CLIENTS LABEL [rivulet-bench flags...]: 128-token random prompts, PROMPTS_PER_CLIENT
# (default 2) times as many as clients (16 at least), 128 tokens each, through the scheduler
# running now.
serve() {
    local clients=$1 label=$2
    shift 2
    "$BIN/rivulet-bench" run --tokenizer "$MODEL" --num-prompts $((clients * ${PROMPTS_PER_CLIENT:-2} < 16 ? 16 : clients * ${PROMPTS_PER_CLIENT:-2})) \
        --max-concurrency "$clients" --random-input-len 128 --random-output-len 128 --ignore-eos --no-progress \
        --admin-url http://127.0.0.1:50052 --label "$label r$round" --json "$OUT/bench.jsonl" "$@" >>"$OUT/bench.log" 2>&1
}
# Each configuration: a label, the scheduler and worker binaries, `worker.cuda_graphs`, and
# optionally one VARIABLE=value for the worker ("gathered": decode attention gathering its KV
# blocks, as before the paged kernel).
configurations=("eager rivulet-scheduler rivulet-worker false"
    "gathered rivulet-scheduler rivulet-worker true RIVULET_KERNELS_NO_CUDA_PAGED_ATTENTION=1"
    "graphs rivulet-scheduler rivulet-worker true")
before_build() { [ -x "$BIN/$1-before" ] && echo "$1-before" || echo "$1"; }
if [ -x "$BIN/rivulet-worker-before" ] || [ -x "$BIN/rivulet-scheduler-before" ]; then
    configurations=("before $(before_build rivulet-scheduler) $(before_build rivulet-worker) true" "${configurations[@]}")
fi
for round in $(seq "${ROUNDS:-1}"); do
for configuration in "${configurations[@]}"; do
    read -r label scheduler_binary worker graphs variable <<<"$configuration"
    [[ " ${CONFIGURATIONS:-$label} " == *" $label "* ]] || continue
    echo "== $label (round $round)"
    env ${variable:+"$variable"} RIVULET_WORKER__BINARY="$BIN/$worker" RIVULET_WORKER__CUDA_GRAPHS=$graphs \
        "$BIN/$scheduler_binary" >"$OUT/scheduler-$label.log" 2>&1 &
    scheduler=$!
    "$BIN/rivulet-bench" wait-ready --timeout-secs 180 || { tail -30 "$OUT/scheduler-$label.log"; kill $scheduler; continue; }
    # Sampled rather than greedy (temperature 1, top-p 0.9): the libtorch sampler's every stage.
    serve 32 "$label 32 clients sampled" --temperature 1 --top-p 0.9
    for clients in "${CLIENTS[@]}"; do
        serve "$clients" "$label ${clients} clients"
    done
    kill $scheduler
    wait $scheduler 2>/dev/null
    grep -iE "graph|panic|error" "$OUT/scheduler-$label.log" | grep -v "request finished" | head -5
done
done
# The summary: one line per run.
grep -E "^=+ .* clients|Output token throughput|P50 TTFT|P50 TPOT|Rivulet steps" "$OUT/bench.log"
