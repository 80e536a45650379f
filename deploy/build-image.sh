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
#   deploy/build-image.sh [--with-model | --gpu] [--tag NAME]
#
#   (default)     rivulet:cpu              the CPU worker; the model mounted at /models
#   --with-model  rivulet:cpu-with-model   the same with the default model baked in
#   --gpu         rivulet:gpu              the main build's worker (links libtorch_cuda) and the
#                                          NVIDIA libraries it resolves (~3 GB); for the gpu overlay
#
# Needs a local Docker engine; the first run on a machine also needs root (debootstrap) and
# Debian's archive. The binaries come from this machine's build: its glibc must not be newer
# than bookworm's (2.36), as on Debian 12 itself.
# Prints the image's size and the time each part took.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
TARGET=runtime
VARIANT=cpu
TAG=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --with-model) TARGET=with-model ;;
        --gpu) VARIANT=gpu ;;
        --tag) TAG="${2:?--tag needs a name}"; shift ;;
        *) echo "usage: $0 [--with-model | --gpu] [--tag NAME]" >&2; exit 2 ;;
    esac
    shift
done
if [[ -z "$TAG" ]]; then
    TAG="rivulet:$VARIANT"
    [[ $TARGET == with-model ]] && TAG="$TAG-with-model"
fi
BASE=rivulet-base:bookworm
WORK="$ROOT/target/image"
MIRROR=http://deb.debian.org/debian
started=$SECONDS
step() { echo "build-image: $* ($((SECONDS - started)) s)"; }
fail() { echo "build-image: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || fail "no Docker engine answers (docker info)"
: "${TORCH_LIB:?torch is not installed in .venv: run scripts/setup.sh first}"

# 1. The base image, once per machine.
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    [[ $EUID -eq 0 ]] || fail "making $BASE needs root (debootstrap): run this once as root"
    if ! command -v debootstrap >/dev/null; then
        apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null
    fi
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    step "debootstrap bookworm (once per machine)"
    debootstrap --variant=minbase --include=ca-certificates,passwd bookworm "$rootfs" "$MIRROR" >/dev/null
    # What the image does not need: package lists and caches, documentation.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
    step "imported $BASE"
fi

# 2. The worker. For the CPU image: torch-sys links torch_cuda only when libtorch_cuda.so is in
# the folder it is given, so a mirror without it gives a worker that needs no CUDA library; its
# own target folder keeps the main build's worker (which links CUDA, for the GPU image) as it is.
cargo build --release --quiet --workspace --bins
if [[ $VARIANT == cpu ]]; then
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
    worker="$WORK/cargo/release/rivulet-worker"
else
    worker="$ROOT/target/release/rivulet-worker"
fi

# 3. The context: binaries, the libraries the worker resolves outside the system's folders.
context="$WORK/context"
rm -rf "$context"
mkdir -p "$context/bin" "$context/lib"
cp "$worker" target/release/rivulet-scheduler "$context/bin/"
# Line tables serve the host's profilers; the image keeps symbols (backtraces) without them.
strip --strip-debug "$context"/bin/*
# Through torch's real folder (not the mirror), where libtorch_cpu's $ORIGIN rpath finds the
# NVIDIA runtime pieces it needs. Captured first: `ldd | grep -q` under pipefail can fail on
# SIGPIPE.
deps="$(LD_LIBRARY_PATH="$TORCH_LIB" ldd "$worker")"
awk '$2 == "=>" && $3 ~ /^\// {print $3}' <<<"$deps" | { grep -v -E '^/(usr/)?lib(64)?/' || true; } |
    while read -r lib; do cp -L "$lib" "$context/lib/"; done
if [[ $VARIANT == gpu ]]; then
    # libtorch_cuda also opens NVIDIA libraries at run time (cuDNN's engines, nvrtc): ldd does
    # not list those, so the GPU image takes the wheels' library folders whole.
    for dir in "$(dirname "$(dirname "$TORCH_LIB")")"/nvidia/*/lib; do
        cp -L "$dir"/*.so* "$context/lib/" 2>/dev/null || true
    done
fi
staged="$(LD_LIBRARY_PATH="$context/lib" ldd "$worker")"
if grep -q "not found" <<<"$staged"; then
    fail "the worker misses a library in the context:
$staged"
fi
if [[ $VARIANT == cpu ]] && grep -q -E "cuda\.so" <<<"$staged"; then
    fail "the CPU worker links a CUDA library:
$staged"
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
