#!/usr/bin/env bash
# One command to serve: installs what is missing, builds, and starts rivulet-scheduler (which
# spawns its worker) on the default model at 127.0.0.1:50051. Extra arguments go to the server;
# configuration comes from rivulet.toml and RIVULET_* variables (see README).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"
cargo build --release --workspace --bins
exec "$ROOT/target/release/rivulet-scheduler" "$@"
