#!/usr/bin/env bash
# The shared-prefix workload (groups of prompts sharing a long prefix) against two Rivulet servers,
# one with the prefix cache and one without (RIVULET_SCHEDULER__PREFIX_CACHE=false), alternating
# runs, then one table with the ratio cache/no-cache.
#
#   bench/prefix_cache.sh [--concurrency 8] [--rounds 2] [--num-prompts 32] [--groups 4]
#                         [--prefix-len 512] [--suffix-len 32] [--output-len 32]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

CLIENTS=8
ROUNDS=2
PROMPTS=32
GROUPS_=4
PREFIX_LEN=512
SUFFIX_LEN=32
OUTPUT_LEN=32
while [[ $# -gt 0 ]]; do
    case "$1" in
        --concurrency) CLIENTS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --num-prompts) PROMPTS="$2"; shift 2 ;;
        --groups) GROUPS_="$2"; shift 2 ;;
        --prefix-len) PREFIX_LEN="$2"; shift 2 ;;
        --suffix-len) SUFFIX_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/prefix-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
start_rivulet 50152 "$OUT/cache.log" RIVULET_SCHEDULER__PREFIX_CACHE=true
start_rivulet 50153 "$OUT/no-cache.log" RIVULET_SCHEDULER__PREFIX_CACHE=false

common=(run --dataset shared-prefix --num-prompts "$PROMPTS" --num-prefix-groups "$GROUPS_"
    --prefix-len "$PREFIX_LEN" --suffix-len "$SUFFIX_LEN" --random-output-len "$OUTPUT_LEN"
    --max-concurrency "$CLIENTS" --ignore-eos --no-progress)
for round in $(seq 1 "$ROUNDS"); do
    echo "== round $round/$ROUNDS"
    # A new seed each round: new prefixes, so the cached server starts each round cold.
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50152 --admin-url "$(admin_url 50152)" --label "prefix cache" \
        --json "$OUT/cache.jsonl" | grep -E "Output token|P50 TTFT|Failed|first error"
    "$BENCH" "${common[@]}" --seed "$round" --url http://127.0.0.1:50153 --admin-url "$(admin_url 50153)" --label "no prefix cache" \
        --json "$OUT/no-cache.jsonl" | grep -E "Output token|P50 TTFT|Failed|first error"
done
echo
echo "### shared prefix: $PROMPTS prompts in $GROUPS_ groups, ${PREFIX_LEN}-token prefix + ${SUFFIX_LEN}-token suffix, ${OUTPUT_LEN} output tokens, concurrency $CLIENTS" \
    | tee "$OUT/table.md"
"$BENCH" compare --left "cache=$OUT/cache.jsonl" --right "no-cache=$OUT/no-cache.jsonl" | tee -a "$OUT/table.md"
echo "results in $OUT"
