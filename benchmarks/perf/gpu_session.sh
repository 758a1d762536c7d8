#!/usr/bin/env bash
# One device call for issue 7's GPU figures: environment; exact vs randomized compression at 7B layer shapes;
# a 130M smoke run of the --gpu-7b path; then the LLaMA-2-7B-shaped run. Logs and results go to $OUT (the
# device tool brings them back). Usage on the GPU machine, from the repository root:
#   bash benchmarks/perf/gpu_session.sh [extra scale.py --gpu-7b arguments]
set -o pipefail
OUT=${OUT:-/tmp/janus-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
  free -g; df -h /tmp; nproc
} 2>&1 | tee "$OUT/env.txt"
python3 -m benchmarks.perf.compression_gpu --out "$OUT/compression_gpu.json" 2>&1 | tee "$OUT/compression_gpu.log" || exit 1
# The --gpu-7b path of the retired profile_rectify.py is scale.py's: replay batch 8, factors stored in bf16
python3 -m benchmarks.perf.scale --gpu-7b --size 130M --m 32 --T 512 --evals 4 --out "$OUT/smoke.json" 2>&1 \
  | tee "$OUT/smoke.log" || exit 1
python3 -m benchmarks.perf.scale --gpu-7b --evals 4 --out "$OUT/gpu_7b.json" "$@" 2>&1 | tee "$OUT/gpu_7b.log"
