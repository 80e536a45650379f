#!/usr/bin/env bash
# Rivulet's CPU kernels (the default) against its libtorch engine (`worker.libtorch_cpu`), or
# against the kernels without their AMX path (`--against no-amx`: RIVULET_KERNELS_NO_AMX=1, the
# AVX-512 products), on the same model and workload: two servers, alternating runs, then one
# table per concurrency with the ratio kernels/other (throughput, TTFT, TPOT).
#
#   bench/engines.sh [--against libtorch|no-amx] [--concurrency "1 8 32"] [--rounds 2]
#                    [--input-len 128] [--output-len 128] [--prompts-per-client 4]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
source "$ROOT/bench/lib.sh"

AGAINST=libtorch
CONCURRENCY="1 8 32"
ROUNDS=2
INPUT_LEN=128
OUTPUT_LEN=128
PROMPTS_PER_CLIENT=4
while [[ $# -gt 0 ]]; do
    case "$1" in
        --against) AGAINST="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --input-len) INPUT_LEN="$2"; shift 2 ;;
        --output-len) OUTPUT_LEN="$2"; shift 2 ;;
        --prompts-per-client) PROMPTS_PER_CLIENT="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

cargo build --release --workspace --bins --quiet
OUT="$ROOT/bench/results/engines-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
case "$AGAINST" in
    libtorch) OTHER_ENV=(RIVULET_WORKER__LIBTORCH_CPU=true) ;;
    no-amx) OTHER_ENV=(RIVULET_KERNELS_NO_AMX=1) ;;
    *) echo "--against: libtorch or no-amx, not $AGAINST" >&2; exit 2 ;;
esac
# The prefix cache off on both, so that every run pays its full prefill.
start_rivulet 50161 "$OUT/kernels.log" RIVULET_SCHEDULER__PREFIX_CACHE=false
start_rivulet 50162 "$OUT/$AGAINST.log" RIVULET_SCHEDULER__PREFIX_CACHE=false "${OTHER_ENV[@]}"

for clients in $CONCURRENCY; do
    prompts=$((clients * PROMPTS_PER_CLIENT))
    common=(run --dataset random --num-prompts "$prompts" --random-input-len "$INPUT_LEN"
        --random-output-len "$OUTPUT_LEN" --max-concurrency "$clients" --ignore-eos --no-progress)
    for round in $(seq 1 "$ROUNDS"); do
        echo "== concurrency $clients, round $round/$ROUNDS"
        for side in kernels:50161 "$AGAINST:50162"; do
            name="${side%%:*}" port="${side##*:}"
            "$BENCH" "${common[@]}" --seed "$round" --url "http://127.0.0.1:$port" --admin-url "$(admin_url "$port")" \
                --label "$name c=$clients" --json "$OUT/$name-c$clients.jsonl" | grep -E "Output token|P50 T|Failed|first error"
        done
    done
done
for clients in $CONCURRENCY; do
    echo
    echo "### concurrency $clients: kernels / $AGAINST" | tee -a "$OUT/table.md"
    "$BENCH" compare --left "kernels=$OUT/kernels-c$clients.jsonl" --right "$AGAINST=$OUT/$AGAINST-c$clients.jsonl" \
        | tee -a "$OUT/table.md"
done
echo "results in $OUT"
