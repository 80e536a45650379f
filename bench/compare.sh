#!/usr/bin/env bash
# Rivulet against llama.cpp's llama-server on the same GGUF file and the same workload, alternating
# runs (Rivulet, peer, Rivulet, peer, ...) so that machine noise falls on both, then one table per
# concurrency with both sides (mean of the rounds) and the ratio Rivulet/peer.
#
#   bench/compare.sh [--concurrency "1 8 32"] [--rounds 2] [--input-len 128] [--output-len 128]
#                    [--prompts-per-client 4] [-- extra rivulet-bench run arguments]
#
# Needs bench/peer/build_llama_server.sh to have been run once (it is not part of CI).
# Results: bench/results/<timestamp>/ (JSON lines per side and concurrency, server logs, tables).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

CONCURRENCY="1 8 32"
ROUNDS=2
INPUT_LEN=128
OUTPUT_LEN=128
PROMPTS_PER_CLIENT=4
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --prompts-per-client) PROMPTS_PER_CLIENT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
RIVULET_PORT=50151
PEER_PORT=50181
start_rivulet "$RIVULET_PORT" "$OUT/rivulet.log"

for clients in $CONCURRENCY; do
    # Each slot holds one request: prompt, output and slack for BOS and tokenization differences.
    start_llama_server "$PEER_PORT" "$clients" $((INPUT_LEN + OUTPUT_LEN + 64)) "$OUT/llama-server-c$clients.log"
    prompts=$((clients * PROMPTS_PER_CLIENT))
    common=(run --dataset random --num-prompts "$prompts" --random-input-len "$INPUT_LEN"
        --random-output-len "$OUTPUT_LEN" --max-concurrency "$clients" --ignore-eos --no-progress "${EXTRA[@]}")
    for round in $(seq 1 "$ROUNDS"); do
        echo "== concurrency $clients, round $round/$ROUNDS"
        "$BENCH" "${common[@]}" --seed "$round" --backend rivulet --url "http://127.0.0.1:$RIVULET_PORT" --admin-url "$(admin_url "$RIVULET_PORT")" \
            --label "rivulet c=$clients" --json "$OUT/rivulet-c$clients.jsonl" | grep -E "Output token|P50 T|Failed|Rivulet steps|first error"
        "$BENCH" "${common[@]}" --seed "$round" --backend openai --url "http://127.0.0.1:$PEER_PORT" \
            --label "llama-server c=$clients" --json "$OUT/peer-c$clients.jsonl" | grep -E "Output token|P50 T|Failed|first error"
    done
    # Stop the peer (it is restarted with the next concurrency's slot count); keep Rivulet.
    kill "${SERVER_PIDS[-1]}" && wait "${SERVER_PIDS[-1]}" 2>/dev/null || true
    unset 'SERVER_PIDS[-1]'
done

for clients in $CONCURRENCY; do
    echo
    echo "### concurrency $clients: ${INPUT_LEN} prompt tokens, ${OUTPUT_LEN} output tokens, mean of $ROUNDS rounds" \
        | tee -a "$OUT/tables.md"
    "$BENCH" compare --left "rivulet=$OUT/rivulet-c$clients.jsonl" --right "llama-server=$OUT/peer-c$clients.jsonl" \
        | tee -a "$OUT/tables.md"
done
echo "results in $OUT"
