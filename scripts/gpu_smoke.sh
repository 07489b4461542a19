#!/usr/bin/env bash
# The GPU checks in one command: versions, the shipped gpt2-small fit, GPU tests, the step benchmark, kernel benches.
# Usage (on a GPU machine, repo root): OUT=/some/dir bash scripts/gpu_smoke.sh [fit|tests|step|kernels|parity|all]...
# Packages the machine lacks (omegaconf) can be carried as wheels in .whl/; they are installed to /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for what in "${@:-all}"; do
  if [[ $what == fit || $what == all ]]; then  # as shipped: compiled and graphed by default
    python3 -m trainer fit configs/gpt2-small.yaml train.steps=80 run.dir=/tmp/fit_gpt2_small run.overwrite=true log.progress=false \
      2>&1 | tee "$OUT/fit_gpt2_small.log" | tail -14
  fi
  if [[ $what == tests || $what == all ]]; then
    # the tests launch their own processes and use little of a GPU: six at a time (pytest-xdist)
    python3 -m pytest -m "gpu or multi_gpu" -q -rs -n 6 --durations=25 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -45
  fi
  if [[ $what == step || $what == all ]]; then
    python3 scripts/bench_step.py --out "$OUT/bench_step.json" 2>&1 | tee "$OUT/bench_step.log" | tail -12
  fi
  if [[ $what == kernels || $what == all ]]; then
    python3 scripts/bench_optimizer.py --out "$OUT/bench_optimizer.json" 2>&1 | tee "$OUT/bench_optimizer.log" | tail -14
    python3 scripts/bench_fused_loss.py --out "$OUT/bench_fused_loss.json" 2>&1 | tee "$OUT/bench_fused_loss.log" | tail -14
  fi
  if [[ $what == parity || $what == all ]]; then
    python3 scripts/parity.py --out "$OUT/parity.json" 2>&1 | tee "$OUT/parity.log" | tail -8
  fi
done
