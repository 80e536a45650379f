#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (default 60 s each) with cargo-fuzz (libFuzzer) on the
# stable toolchain (RUSTC_BOOTSTRAP=1 lets it use the sanitizer flags). The corpus in
# fuzz/corpus/<target> grows as coverage does; a crash is written to fuzz/artifacts/<target> and
# fails the run — turn it into a unit test beside the code it broke.
#
#   fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECONDS_EACH="${1:-60}"
shift || true
TARGETS=("$@")
if [[ ${#TARGETS[@]} -eq 0 ]]; then
    TARGETS=(gguf_parse openai_request stop_strings ipc_messages)
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for target in "${TARGETS[@]}"; do
    mkdir -p "fuzz/corpus/$target"
    echo "== $target ($SECONDS_EACH s)"
    cargo fuzz run --fuzz-dir fuzz "$target" "fuzz/corpus/$target" -- \
        -max_total_time="$SECONDS_EACH" -max_len=65536 -rss_limit_mb=4096
done
