# Sourced by the other scripts: the project-local Python environment and libtorch from its
# `torch` wheel (tch 0.24 <=> torch 2.11.0), found through LIBTORCH_USE_PYTORCH.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="$ROOT/.venv"
export PATH="$VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
export TORCH_VERSION="2.11.0"
export MODEL_FILE="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
torch_lib_dir() {
    local dir
    for dir in "$VENV"/lib/python3*/site-packages/torch/lib; do
        [ -d "$dir" ] && { echo "$dir"; return; }
    done
}
if TORCH_LIB="$(torch_lib_dir)" && [ -n "$TORCH_LIB" ]; then
    export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
