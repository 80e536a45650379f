# Shared helpers of the benchmark scripts: start servers on loopback, wait until they answer, stop
# them on exit. Source it; it expects ROOT to be set and scripts/env.sh already sourced.

BENCH="$ROOT/target/release/rivulet-bench"
MODEL="${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
SERVER_PIDS=()

stop_servers() {
    for pid in "${SERVER_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${SERVER_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    SERVER_PIDS=()
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

# start_llama_server PORT SLOTS CONTEXT_PER_SLOT LOG: llama.cpp's server with SLOTS parallel slots.
start_llama_server() {
    local port=$1 slots=$2 per_slot=$3 log=$4
    local binary="$ROOT/bench/peer/.build/llama-server"
    [[ -x "$binary" ]] || { echo "no $binary: run bench/peer/build_llama_server.sh first" >&2; exit 1; }
    "$binary" -m "$MODEL" --host 127.0.0.1 --port "$port" \
        --parallel "$slots" --ctx-size $((slots * per_slot)) \
        --threads "$(nproc)" --threads-batch "$(nproc)" --no-webui >"$log" 2>&1 &
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
