#!/usr/bin/env bash
# Adaptive batching on against off (scheduler.adaptive_batching): long prompts arriving while
# others decode, so prefill chunks compete with decode steps. Two servers, alternating runs of the
# same workload, then one table with the ratio adaptive/fixed (TTFT, TPOT, ITL, throughput).
#
#   bench/adaptive.sh [--concurrency 16] [--rounds 2] [--num-prompts 48] [--input-len 768]
#                     [--output-len 64] [--target-step-ms 100] [--request-rate 4]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

CLIENTS=16
ROUNDS=2
PROMPTS=48
INPUT_LEN=768
OUTPUT_LEN=64
TARGET_MS=100
RATE=4
while [[ $# -gt 0 ]]; do
    case "$1" in
        --concurrency) CLIENTS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --num-prompts) PROMPTS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --target-step-ms) TARGET_MS="$2"; shift 2 ;;
        --request-rate) RATE="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/adaptive-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
start_rivulet 50157 "$OUT/fixed.log" RIVULET_SCHEDULER__ADAPTIVE_BATCHING=false
start_rivulet 50158 "$OUT/adaptive.log" RIVULET_SCHEDULER__ADAPTIVE_BATCHING=true \
    RIVULET_SCHEDULER__ADAPTIVE_TARGET_STEP_MS="$TARGET_MS"

common=(run --dataset random --num-prompts "$PROMPTS" --random-input-len "$INPUT_LEN"
    --random-output-len "$OUTPUT_LEN" --max-concurrency "$CLIENTS" --request-rate "$RATE"
    --ignore-eos --no-progress)
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round/$ROUNDS"
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50157 --admin-url "$(admin_url 50157)" \
        --label "fixed" --json "$OUT/fixed.jsonl" | grep -E "Output token|P99 ITL|Failed|first error"
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50158 --admin-url "$(admin_url 50158)" \
        --label "adaptive" --json "$OUT/adaptive.jsonl" | grep -E "Output token|P99 ITL|Failed|first error"
done
echo
echo "### $PROMPTS random ${INPUT_LEN}-token prompts at $RATE/s, ${OUTPUT_LEN} output tokens, concurrency $CLIENTS: adaptive (target ${TARGET_MS} ms) / fixed" \
    | tee "$OUT/table.md"
"$BENCH" compare --left "adaptive=$OUT/adaptive.jsonl" --right "fixed=$OUT/fixed.jsonl" | tee -a "$OUT/table.md"
echo "results in $OUT"
