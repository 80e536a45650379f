#!/usr/bin/env bash
# One worker replica against N (default 2) on the same machine, the cores split between the N
# workers (worker.threads unset), alternating runs of the same workload, then one table with the
# ratio N/1. On a 2-core machine this measures what splitting costs or gains; on a bigger one, how
# the replicas scale.
#
#   bench/replicas.sh [--replicas 2] [--concurrency 32] [--rounds 2] [--num-prompts 64]
#                     [--input-len 128] [--output-len 128]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

REPLICAS=2
CLIENTS=32
ROUNDS=2
PROMPTS=64
INPUT_LEN=128
OUTPUT_LEN=128
while [[ $# -gt 0 ]]; do
    case "$1" in
        --replicas) REPLICAS="$2"; shift 2 ;;
        --concurrency) CLIENTS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --num-prompts) PROMPTS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/replicas-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
start_rivulet 50154 "$OUT/one.log" RIVULET_WORKER__REPLICAS=1
start_rivulet 50155 "$OUT/many.log" RIVULET_WORKER__REPLICAS="$REPLICAS"

common=(run --dataset random --num-prompts "$PROMPTS" --random-input-len "$INPUT_LEN"
    --random-output-len "$OUTPUT_LEN" --max-concurrency "$CLIENTS" --ignore-eos --no-progress)
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round/$ROUNDS"
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50154 --admin-url "$(admin_url 50154)" --label "1 replica" \
        --json "$OUT/one.jsonl" | grep -E "Output token|P50 T|Failed|first error"
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50155 --admin-url "$(admin_url 50155)" --label "$REPLICAS replicas" \
        --json "$OUT/many.jsonl" | grep -E "Output token|P50 T|Failed|first error"
done
echo
echo "### $PROMPTS random ${INPUT_LEN}-token prompts, ${OUTPUT_LEN} output tokens, concurrency $CLIENTS: $REPLICAS replicas / 1 ($(nproc) cores)" \
    | tee "$OUT/table.md"
"$BENCH" compare --left "$REPLICAS-replicas=$OUT/many.jsonl" --right "1-replica=$OUT/one.jsonl" | tee -a "$OUT/table.md"
echo "results in $OUT"
