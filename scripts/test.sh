#!/usr/bin/env bash
# One command to test: installs what is missing (including the Hugging Face references), builds,
# and runs every test: unit tests, the worker against the real model, and end-to-end tests over
# gRPC with the real worker process. Extra arguments go to `cargo test`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" --test
cd "$ROOT"
cargo build --release --workspace --bins
cargo test --release --workspace --no-fail-fast "$@"
