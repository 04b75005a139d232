#!/usr/bin/env bash
# The GPU path, checked in under 10 minutes on one CUDA GPU with no hub access: random-weight
# Qwen2 models of 0.5B and ~100M parameters, a few GRPO steps each under assay with the vLLM
# backend (bf16), assay with the torch backend, and TRL's GRPOTrainer (use_vllm=True,
# colocate); prints generation tokens/s, s/step and peak GPU memory side by side
# (benchmarks/gpu_check.py). On a machine without CUDA it runs the same code on tiny models
# in fp32 on the CPU, which is how it is tested here.
#
#   scripts/gpu-check.sh            # sets up .venv-engine (ASSAY_TORCH=cuda where nvidia-smi works) and TRL
#   scripts/gpu-check.sh --tiny     # force the tiny CPU shapes
#   ASSAY_GPU_CHECK_LIMIT=600       # the whole check's time limit in seconds (default 600)
set -euo pipefail
cd "$(dirname "$0")/.."

args=("$@")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  export ASSAY_TORCH=${ASSAY_TORCH:-cuda}
else
  [[ " ${args[*]-} " == *" --tiny "* ]] || args+=(--tiny)
fi
bash scripts/install-engine.sh
PY=.venv-engine/bin/python
"$PY" -c "import trl" 2>/dev/null || "$PY" -m pip --disable-pip-version-check -q install trl==1.16.0 accelerate==1.16.0
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec timeout "${ASSAY_GPU_CHECK_LIMIT:-600}" "$PY" benchmarks/gpu_check.py "${args[@]}"
