#!/usr/bin/env bash
# The GPU path, checked in one go on a CUDA machine as it is found: its own Python with CUDA
# torch already installed, no internet, no vLLM. What it lacks comes prepared from a CPU machine
# (`scripts/gpu-prepare.sh` puts the wheels in ./.whl; carry that folder with the project).
#
#   1. assay is installed the way a user would, `pip install -e .` into a venv that sees the
#      machine's own packages (offline, from ./.whl), and torch must come out unchanged;
#   2. the `gpu` tests (tests/test_gpu.py: sampling, every training path with a resume,
#      evaluation, reward models, pre-training, all on CUDA);
#   3. a 20-step main job on CUDA (`assay train model.device=cuda`): held-out accuracy before → after
#      (and, on a machine with 2 GPUs or more, 10 steps under `torchrun --nproc-per-node 2`);
#   4. benchmarks/gpu_check.py at the 0.5B and 100M shapes in bf16: the torch backend's decoding
#      against Hugging Face generate (tokens/s, ms per token step, fraction of the bandwidth
#      roofline), GRPO steps against TRL (s/step), peak device memory.
#
# Without a CUDA device it runs the same steps on the CPU (tests with ASSAY_TEST_DEVICE=cpu,
# tiny benchmark shapes) in .venv: the check of the script itself. ASSAY_GPU_CHECK_INSTALL=1 makes
# it install as on a GPU machine first (step 1, into a venv over $PYTHON's packages), which is how
# the offline install and the wheel list are checked where no GPU is lent. Results go to $OUT.
#
#   scripts/gpu-check.sh               # everything, within ASSAY_GPU_CHECK_LIMIT seconds (default 480)
#   ASSAY_GPU_CHECK_INSTALL=1 PYTHON=/path/to/base/python scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

LIMIT=${ASSAY_GPU_CHECK_LIMIT:-480}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
left() { echo $((LIMIT - SECONDS)); }
say() { echo "gpu-check [$((SECONDS))s]: $*"; }
status=0

CUDA=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nvidia-smi -L
  CUDA=1
fi
if [ "$CUDA" = 1 ] || [ "${ASSAY_GPU_CHECK_INSTALL:-0}" = 1 ]; then
  BASE=${PYTHON:-python3}
  torch_before=$("$BASE" -c 'import torch; print(torch.__version__)')
  VENV=/tmp/assay-gpu-venv
  rm -rf "$VENV" && "$BASE" -m venv --system-site-packages "$VENV"
  # a venv made from a venv (this image's python3 is one) sees only the base interpreter's packages:
  # point the new one at this Python's own site-packages too (after its own, which win)
  site_dir=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site_dir/_assay_base_python.pth"
  PY=$VENV/bin/python
  PIP=("$PY" -m pip --disable-pip-version-check install --no-index --find-links .whl)
  WANT=(-e ".[image]" trl==1.16.0 pytest)  # assay with the image policies' UNet, TRL for the benchmark, pytest for the tests
  # would installing assay replace this machine's torch? pip's own plan says
  "${PIP[@]}" -q --dry-run --report "$OUT/pip-plan.json" "${WANT[@]}" >"$OUT/pip.log" 2>&1
  "$PY" - "$OUT/pip-plan.json" <<'PY' || status=1
import json, sys
try:
    plan = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(print("gpu-check: pip could not plan the install offline (see pip.log)") or 0)
names = sorted(i["metadata"]["name"] for i in plan["install"])
print("gpu-check: pip install -e . would install:", ", ".join(names))
sys.exit(1 if any(n.lower() == "torch" for n in names) else 0)
PY
  if "${PIP[@]}" -q "${WANT[@]}" >>"$OUT/pip.log" 2>&1; then
    say "pip install -e . (offline, from .whl): ok; torch $torch_before before, $("$PY" -c 'import torch; print(torch.__version__)') after"
  else
    say "pip install -e . with its requirements failed offline (tail of $OUT/pip.log below); installing without them"
    tail -3 "$OUT/pip.log"; status=1
    "${PIP[@]}" -q --no-deps -e . .whl/*.whl >>"$OUT/pip.log" 2>&1 || { say "FAILED: even without requirements"; exit 1; }
  fi
  torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
  [ "$torch_before" = "$torch_after" ] || { say "FAILED: installing assay replaced torch ($torch_before -> $torch_after)"; status=1; }
else
  PY=${PYTHON:-.venv/bin/python}
fi
if [ "$CUDA" = 1 ]; then
  DEVICE=cuda
  BENCH=()
else
  say "no CUDA device: the same steps on the CPU, at tiny shapes"
  DEVICE=cpu
  export ASSAY_TEST_DEVICE=cpu
  BENCH=(--tiny)
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

say "gpu tests"
timeout 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "FAILED: gpu tests"; status=1; }

say "main job on $DEVICE (20 steps)"
rm -rf "$OUT/runs/gpu-main"
timeout 120 "$PY" -m assay train --no-progress model.device="$DEVICE" train.steps=20 train.eval_every=10 train.eval_n=200 \
  output_dir="$OUT/runs" run_name=gpu-main >"$OUT/main.log" 2>&1 || { say "FAILED: main job"; tail -5 "$OUT/main.log"; status=1; }
"$PY" - "$OUT/runs/gpu-main/metrics.jsonl" <<'PY' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
acc = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
steps = [r["perf/step_s"] for r in rows if "perf/step_s" in r]
print(f"gpu-check: main job: held-out greedy accuracy {acc[0]:.3f} -> {acc[-1]:.3f}; median {sorted(steps)[len(steps) // 2]:.3f} s/step")
sys.exit(0 if acc[-1] > acc[0] else 1)
PY

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPUS:-0}" -ge 2 ]; then
  say "torchrun on 2 GPUs (10 steps, FSDP2)"
  timeout 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m assay train --no-progress model.device=cuda \
    train.steps=10 train.eval_every=10 train.eval_n=200 output_dir="$OUT/runs" run_name=gpu-two >"$OUT/two.log" 2>&1 \
    && grep "held-out accuracy" "$OUT/two.log" || { say "FAILED: torchrun on 2 GPUs"; tail -5 "$OUT/two.log"; status=1; }
fi

say "benchmark ($(left) s left)"
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" "$PY" benchmarks/gpu_check.py "${BENCH[@]}" --budget $(($(left) - 15)) --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { say "FAILED: benchmark"; status=1; }
else
  say "no time left for the benchmark"; status=1
fi
say "done (exit $status)"
exit $status
