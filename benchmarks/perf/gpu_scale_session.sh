#!/usr/bin/env bash
# One device call for the 7B figures of issues 16/17 (benchmarks/perf/scale.py): environment; a 130M smoke run on
# the GPU; the fixed 4-evaluation LLaMA-2-7B-shaped run; then, time permitting, the run to convergence with default
# settings. Results are appended to benchmarks/perf/results/scale_7b_gpu.json and copied with the logs to $OUT.
# Usage on the GPU machine, from the repository root:  bash benchmarks/perf/gpu_scale_session.sh
set -o pipefail
OUT=${OUT:-/tmp/janus-gpu-out}; mkdir -p "$OUT"
CACHE=${CACHE:-/tmp/janus-cache}; mkdir -p "$CACHE"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  free -g; df -h /tmp; nproc
} 2>&1 | tee "$OUT/env.txt"
python3 benchmarks/perf/scale.py --gpu-7b --size 130M --m 32 --T 512 --evals 4 --cache "$CACHE" \
  --out "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log" || exit 1
python3 benchmarks/perf/scale.py --gpu-7b --evals 4 --cache "$CACHE" 2>&1 | tee "$OUT/scale_7b_4evals.log"
cp benchmarks/perf/results/scale_7b_gpu.json "$OUT/" 2>/dev/null
python3 benchmarks/perf/scale.py --gpu-7b --evals 0 --cache "$CACHE" 2>&1 | tee "$OUT/scale_7b_converge.log"
cp benchmarks/perf/results/scale_7b_gpu.json "$OUT/" 2>/dev/null
