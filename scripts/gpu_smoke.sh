#!/usr/bin/env bash
# One GPU session's checks, in one call of the device tool: versions, the gpt2-small fit, GPU tests, kernel benches.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash scripts/gpu_smoke.sh [fit|tests|kernels|all]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages the GPU image lacks (omegaconf), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
what=${1:-all}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [[ $what == fit || $what == all ]]; then
  for impl in fused auto; do
    python3 -m trainer fit configs/gpt2-small.yaml train.steps=50 optim.impl=$impl run.dir=/tmp/fit_$impl \
      checkpoint.enabled=false log.progress=false 2>&1 | tee "$OUT/fit_gpt2_small_eager_$impl.log" | tail -4
  done
fi
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m "gpu or multi_gpu" -q -rs 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
fi
if [[ $what == kernels || $what == all ]]; then
  python3 scripts/bench_optimizer.py --out "$OUT/bench_optimizer.json" 2>&1 | tee "$OUT/bench_optimizer.log" | tail -20
  python3 scripts/bench_fused_loss.py --out "$OUT/bench_fused_loss.json" 2>&1 | tee "$OUT/bench_fused_loss.log" | tail -20
fi
