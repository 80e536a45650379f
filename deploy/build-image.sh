#!/usr/bin/env bash
# Builds Rivulet's container image on this machine, where no registry can be reached:
#   1. the base, `rivulet-base:bookworm`: Debian bookworm from debootstrap, imported once per
#      machine (skipped when the image exists);
#   2. the CPU worker, linked against a mirror of torch's library folder without
#      libtorch_cuda.so, so that it needs libtorch_cpu but none of the CUDA libraries (~2.7 GB);
#   3. the build context: the two binaries, the libraries `ldd` resolves outside the system's
#      folders, deploy/rivulet.toml (and the model for --with-model);
#   4. `docker build` of deploy/Dockerfile.
#
#   deploy/build-image.sh [--with-model] [--tag NAME]     (default tag rivulet:cpu)
#
# Prints the image's size and the time each part took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
TARGET=runtime
TAG=rivulet:cpu
while [[ $# -gt 0 ]]; do
    case "$1" in
        --with-model) TARGET=with-model; TAG=rivulet:cpu-with-model ;;
        --tag) TAG="$2"; shift ;;
        *) echo "usage: $0 [--with-model] [--tag NAME]" >&2; exit 2 ;;
    esac
    shift
done
BASE=rivulet-base:bookworm
WORK="$ROOT/target/image"
MIRROR=http://deb.debian.org/debian
started=$SECONDS
step() { echo "build-image: $* ($((SECONDS - started)) s)"; }

# 1. The base image, once per machine.
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    rootfs="$WORK/rootfs"
    rm -rf "$rootfs"
    step "debootstrap bookworm (once per machine)"
    debootstrap --variant=minbase --include=ca-certificates,passwd bookworm "$rootfs" "$MIRROR" >/dev/null
    # What the image does not need: package lists and caches, documentation.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    step "imported $BASE"
fi

# 2. The CPU worker. torch-sys links torch_cuda only when libtorch_cuda.so is in the folder it
# is given; its own target folder keeps the main build's worker (which links CUDA) as it is.
torch_dir="$(dirname "$TORCH_LIB")"
libtorch="$WORK/libtorch-cpu"
mkdir -p "$libtorch/lib"
ln -sfn "$torch_dir/include" "$libtorch/include"
for lib in "$TORCH_LIB"/*; do
    [[ "$(basename "$lib")" == libtorch_cuda.so ]] || ln -sfn "$lib" "$libtorch/lib/"
done
step "building the CPU worker"
env -u LIBTORCH_USE_PYTORCH LIBTORCH="$libtorch" LIBTORCH_BYPASS_VERSION_CHECK=1 \
    CARGO_TARGET_DIR="$WORK/cargo" cargo build --release --quiet -p rivulet-worker
cargo build --release --quiet -p rivulet-scheduler
worker="$WORK/cargo/release/rivulet-worker"

# 3. The context: binaries, the libraries the worker resolves outside the system's folders.
context="$WORK/context"
rm -rf "$context"
mkdir -p "$context/bin" "$context/lib"
cp "$worker" target/release/rivulet-scheduler "$context/bin/"
# Line tables serve the host's profilers; the image keeps symbols (backtraces) without them.
strip --strip-debug "$context"/bin/*
# Through torch's real folder (not the mirror), where libtorch_cpu's $ORIGIN rpath finds the
# NVIDIA runtime pieces it needs.
LD_LIBRARY_PATH="$TORCH_LIB" ldd "$worker" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    grep -v -E '^/(usr/)?lib(64)?/' | while read -r lib; do
        cp -L "$lib" "$context/lib/"
    done
if LD_LIBRARY_PATH="$context/lib" ldd "$worker" | grep -q -E "cuda\.so|not found"; then
    echo "build-image: the CPU worker links a CUDA library, or misses one:" >&2
    LD_LIBRARY_PATH="$context/lib" ldd "$worker" >&2
    exit 1
fi
cp deploy/rivulet.toml "$context/"
if [[ $TARGET == with-model ]]; then
    mkdir -p "$context/models"
    cp "$MODEL_FILE" "$context/models/"
fi
step "context staged: $(du -sh "$context" | cut -f1)"

# 4. The image.
docker build --quiet --file deploy/Dockerfile --target "$TARGET" --build-arg "BASE_IMAGE=$BASE" \
    --tag "$TAG" "$context" >/dev/null
size=$(docker image inspect --format '{{.Size}}' "$TAG")
step "built $TAG: $((size / 1000000)) MB"
