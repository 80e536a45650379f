#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the benchmark peer) from the llama.cpp sources vendored in the
# PyPI source distribution of llama-cpp-python. CPU build, tuned for this machine (GGML_NATIVE).
#
# Output: bench/peer/.build/llama-server (git-ignored). Takes ~15-20 minutes on 2 cores; it is never
# run by CI. Re-running it is a no-op once the binary exists (pass --force to rebuild).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER_DIR="$ROOT/bench/peer/.build"
VERSION="0.3.36"
SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
BINARY="$PEER_DIR/llama-server"

if [[ -x "$BINARY" && "${1:-}" != "--force" ]]; then
    echo "llama-server already built: $BINARY"
    exit 0
fi
mkdir -p "$PEER_DIR"

# Build tools come from PyPI into their own venv, so nothing is installed system-wide.
TOOLS_VENV="$PEER_DIR/tools-venv"
if [[ ! -x "$TOOLS_VENV/bin/cmake" ]]; then
    python3 -m venv "$TOOLS_VENV"
    "$TOOLS_VENV/bin/pip" install --quiet cmake ninja
fi

SDIST="$PEER_DIR/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]] || ! echo "$SHA256  $SDIST" | sha256sum --check --status; then
    echo "downloading llama-cpp-python $VERSION (source distribution)"
    python3 - "$VERSION" "$SDIST" <<'PY'
import json, sys, urllib.parse, urllib.request
version, target = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-python/json"
release = json.load(urllib.request.urlopen(index))["releases"][version]
sdist = next(f for f in release if f["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), target)
PY
    echo "$SHA256  $SDIST" | sha256sum --check
fi

SRC="$PEER_DIR/src"
rm -rf "$SRC" && mkdir -p "$SRC"
tar -xzf "$SDIST" -C "$SRC" --strip-components=1
LLAMA_CPP="$SRC/vendor/llama.cpp"
[[ -d "$LLAMA_CPP/tools/server" ]] || { echo "no tools/server in $LLAMA_CPP" >&2; exit 1; }

export PATH="$TOOLS_VENV/bin:$PATH"
cmake -S "$LLAMA_CPP" -B "$PEER_DIR/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$PEER_DIR/cmake" --target llama-server -j "$(nproc)"
cp "$PEER_DIR/cmake/bin/llama-server" "$BINARY"
echo "built $BINARY"
"$BINARY" --version 2>&1 | head -3 || true
