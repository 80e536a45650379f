#!/usr/bin/env bash
# One command to test: installs what is missing (including the Hugging Face references), builds,
# and runs every test: unit tests, the worker against the real model, end-to-end tests over gRPC
# and HTTP with the real worker processes, the chaos soak, the container image and the pod shape
# in Docker (when an engine is present), the Kubernetes manifests offline; then each fuzz target
# for a bounded time (FUZZ_SECONDS, default 20). Extra arguments go to `cargo test` (and skip the
# fuzzing: a filtered run is for one thing).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" --test
cd "$ROOT"
cargo build --release --workspace --bins
cargo test --release --workspace --no-fail-fast "$@"
if [ $# -eq 0 ]; then
    "$ROOT/fuzz/run.sh" --check "${FUZZ_SECONDS:-20}"
fi
