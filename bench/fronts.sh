#!/usr/bin/env bash
# Rivulet's two fronts against one server: gRPC `StreamGenerate` and the OpenAI-compatible HTTP
# `/v1/completions` (server-sent events), alternating runs of the same workload at each
# concurrency (prefix cache off, so neither front reuses the other's prompts), then one table per
# concurrency with the ratio HTTP/gRPC.
#
#   bench/fronts.sh [--concurrency "8 32"] [--rounds 2] [--num-prompts 64]
#                   [--input-len 128] [--output-len 64]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

CONCURRENCY="8 32"
ROUNDS=2
PROMPTS=64
INPUT_LEN=128
OUTPUT_LEN=64
while [[ $# -gt 0 ]]; do
    case "$1" in
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --num-prompts) PROMPTS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/fronts-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
PORT=50156
# Both fronts send the same prompts (same seed): without the prefix cache the second would be
# served from what the first computed.
start_rivulet "$PORT" "$OUT/rivulet.log" RIVULET_SCHEDULER__PREFIX_CACHE=false

for clients in $CONCURRENCY; do
    common=(run --dataset random --num-prompts "$PROMPTS" --random-input-len "$INPUT_LEN"
        --random-output-len "$OUTPUT_LEN" --max-concurrency "$clients" --ignore-eos --no-progress)
    for round in $(seq 1 "$ROUNDS"); do
        echo "== concurrency $clients, round $round/$ROUNDS"
        "$BENCH" "${common[@]}" --seed "$round" --backend rivulet --url "http://127.0.0.1:$PORT" \
            --label "gRPC" --json "$OUT/grpc-$clients.jsonl" | grep -E "Output token|Failed|first error"
        "$BENCH" "${common[@]}" --seed "$round" --backend openai --url "$(http_url "$PORT")" \
            --label "HTTP" --json "$OUT/http-$clients.jsonl" | grep -E "Output token|Failed|first error"
    done
done
for clients in $CONCURRENCY; do
    echo
    echo "### $PROMPTS random ${INPUT_LEN}-token prompts, ${OUTPUT_LEN} output tokens, concurrency $clients: HTTP / gRPC" \
        | tee -a "$OUT/table.md"
    "$BENCH" compare --left "HTTP=$OUT/http-$clients.jsonl" --right "gRPC=$OUT/grpc-$clients.jsonl" | tee -a "$OUT/table.md"
done
echo "results in $OUT"
