#!/usr/bin/env bash
# One command to serve: installs what is missing, builds, and starts rivulet-scheduler (which
# spawns its worker) on the default model: gRPC on 127.0.0.1:50051, OpenAI-compatible HTTP on
# 127.0.0.1:8000, Admin on 127.0.0.1:50052. Extra arguments go to the server (`--help`);
# configuration comes from rivulet.toml and RIVULET_* variables (see README).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
cargo build --release --workspace --bins
exec "$ROOT/target/release/rivulet-scheduler" "$@"
