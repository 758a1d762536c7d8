#!/usr/bin/env bash
# The GPU session of issues 16, 21 and 34: LLaMA-2-7B-shaped runs on one H100 (78 GiB, 128 GiB host, 64 GiB disk),
# every model built from its config with random weights, so nothing needs the network. A device call lasts at most
# 10 minutes and a 4-evaluation 7B run alone takes 8-10, so each call runs only the phases named on its command line
# (`bash benchmarks/perf/gpu_scale_session.sh` with none prints the calls to make):
#
#   env       nvidia-smi, free, df, versions, whether bitsandbytes imports: $OUT/env.txt, $OUT/env.json (seconds)
#   smoke     scale.py --gpu-7b at 130M, m=32, T=512, 4 evaluations (about a minute)
#   profile   capture_profile.py: one capture at 130M (m=32) and at 7B (m=16), T=512, timed by phase and profiled by
#             operation, with the host copies of one batch's factors timed three ways (issue 65; 3-4 minutes)
#   7b        scale.py --gpu-7b at the LLaMA-2-7B shape, m=256, T=512, r=32, 4 evaluations (a call of its own)
#   repair    the 7B shape, m=64, T=512, 2 evaluations, then the repair after JANUS (32 distillation steps on 64
#             new-task samples): JANUS's and the repair's seconds and the memory plan with the repair (issue 65 item 3)
#   qlora     qlora.py --size 7b --quants nf4 --output none --device-memory-gib 20, m=64, replay batch 4: the
#             rectification of a LoRA on an nf4 base, without the adapter write-back, in 20 GiB of the H100 (as on a
#             24 GB card: the allocator refuses beyond it); the target: peak GPU <= 20 GiB (4-6 minutes)
#   converge  the 7B run with default settings, to convergence (longer than a call: its partial figures)
#   pack-bnb  run HERE, not on the device: this venv's bitsandbytes, trimmed to its CUDA 13 library, into .whl/site
#             (the GPU image has no bitsandbytes); a call with the qlora phase then carries .whl
#
# Each python phase runs under `timeout` with what is left of PHASE_LIMIT_S (default 560 s for the whole call: the
# call ends before the device's 600 s even after the kill grace) and writes $OUT/<phase>.json at its end; while it
# runs, it rewrites $OUT/<phase>.partial.json after every stage and Rectifier step (elapsed and per-step seconds,
# evaluations, peak GPU and host memory, the memory plan once known). A phase that times out or fails gets a
# $OUT/<phase>.json saying so ("status", "exit_code", its partial figures inside), and the later phases still run.
# Exit status: 0 when every phase finished, 1 otherwise. Factors spill to $CACHE/<phase>, deleted after the phase.
#
# Environment: OUT; CACHE (default /tmp/janus-cache); PHASE_LIMIT_S (560); SMOKE_LIMIT_S (150: the smoke phase's
# cap, so that a later phase of the same call keeps its time); KILL_GRACE_S (15); PYTHON (python3);
# JANUS_GPU_SESSION_DEVICE (cuda; cpu smoke-tests the phases); JANUS_GPU_SESSION_TINY=1 (tiny shapes: smoke 5M m=8
# T=16, 7b and converge 9M m=8 T=16, qlora its quick size); JANUS_GPU_SESSION_EVALS (the smoke and 7b phases'
# Jacobian evaluations, even; default 4); JANUS_GPU_SESSION_QLORA_M (the qlora phase's replay samples, default 64:
# a capture costs about m/256 of a dense 7B capture, and its factors, m x 0.16 GB in bf16 or 0.32 GB in float32,
# must fit host memory and the disk beside the 13.5 GB saved model); JANUS_GPU_SESSION_QLORA_BATCH (its replay
# batch, default 4: the memory plan's bound for 20 GiB of GPU memory at 7B, see docs/limitations.md).
set -o pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/janus-gpu-out}; CACHE=${CACHE:-/tmp/janus-cache}
PHASE_LIMIT_S=${PHASE_LIMIT_S:-560}; SMOKE_LIMIT_S=${SMOKE_LIMIT_S:-150}; KILL_GRACE_S=${KILL_GRACE_S:-15}
PYTHON=${PYTHON:-python3}; DEVICE=${JANUS_GPU_SESSION_DEVICE:-cuda}; TINY=${JANUS_GPU_SESSION_TINY:-0}
EVALS=${JANUS_GPU_SESSION_EVALS:-4}; QLORA_M=${JANUS_GPU_SESSION_QLORA_M:-64}
QLORA_BATCH=${JANUS_GPU_SESSION_QLORA_BATCH:-4}
MIN_PHASE_S=5  # a phase with less left than this is skipped, not started
LOG=$OUT/session.log

usage() {
  cat <<EOF
usage: bash benchmarks/perf/gpu_scale_session.sh PHASE...   (phases: env smoke profile 7b repair qlora converge;
pack-bnb runs here)

One device call (at most 10 minutes) per line, in this order:
  here, once: bash benchmarks/perf/gpu_scale_session.sh pack-bnb         # bitsandbytes for the qlora phase: .whl
  call 1:     bash benchmarks/perf/gpu_scale_session.sh env smoke qlora  # carry .whl; about 6 minutes
  call 2:     bash benchmarks/perf/gpu_scale_session.sh 7b               # up to 9.5 minutes (partial if cut)
  call 3:     JANUS_GPU_SESSION_EVALS=2 bash benchmarks/perf/gpu_scale_session.sh 7b   # optional: a complete row
  issue 65:   bash benchmarks/perf/gpu_scale_session.sh env profile      # where a capture's time goes; 3-4 minutes
  issue 65:   bash benchmarks/perf/gpu_scale_session.sh repair           # JANUS + the repair at 7B (m=64)
  optional:   bash benchmarks/perf/gpu_scale_session.sh converge         # partial figures only at 7B
Results: \$OUT/<phase>.json, \$OUT/<phase>.partial.json, \$OUT/env.txt, \$OUT/session.log (at most 8 files a call).
On a CPU: JANUS_GPU_SESSION_DEVICE=cpu JANUS_GPU_SESSION_TINY=1 OUT=/tmp/x bash $0 smoke qlora
EOF
}

note() { echo "[$(date -u +%H:%M:%S)] gpu_scale_session: $*" | tee -a "$LOG" >&2; }

phase_command() {  # the python command of phase $1, in the array CMD
  local smoke=(--size 130M --m 32 --T 512) big=(--size 7B --m 256 --T 512)
  local profile=(--sizes 130M:32,7B:16 --T 512) repair=(--size 7B --m 64 --T 512)
  local qlora=(--size 7b --m "$QLORA_M" --device-memory-gib 20)  # a 24 GB card: what QLoRA users have
  if [[ $TINY == 1 ]]; then smoke=(--size 5M --m 8 --T 16); big=(--size 9M --m 8 --T 16); qlora=(--size quick)
    profile=(--sizes 5M:8 --T 16); repair=(--size 9M --m 8 --T 16); fi
  qlora+=(--batch-size "$QLORA_BATCH")
  local files=(--cache "$CACHE/$1" --out "$OUT/$1.json" --partial "$OUT/$1.partial.json")
  local scale=("$PYTHON" -m benchmarks.perf.scale --gpu-7b --device "$DEVICE" "${files[@]}")
  case $1 in
    env) CMD=("$PYTHON" -m benchmarks.perf.scale --env "$OUT/env.json" --cache "$CACHE") ;;
    smoke) CMD=("${scale[@]}" "${smoke[@]}" --evals "$EVALS") ;;
    # F from one timed pass at 7B (after its warm-up batch): the call's seconds go to the rectification
    7b) CMD=("${scale[@]}" "${big[@]}" --evals "$EVALS" --f-passes 1) ;;
    profile) CMD=("$PYTHON" -m benchmarks.perf.capture_profile "${profile[@]}" --device "$DEVICE" --cache "$CACHE/$1"
                  --out "$OUT/$1.json" --text "$OUT/$1.txt") ;;
    repair) CMD=("${scale[@]}" "${repair[@]}" --evals 2 --f-passes 1 --distill-steps 32) ;;
    converge) CMD=("${scale[@]}" "${big[@]}" --evals 0 --f-passes 1) ;;
    # --output none: the rectification without the adapter write-back (rectify_adapted_layers; the write-back's 224
    # float64 SVDs at 7B take minutes by estimate)
    qlora) CMD=("$PYTHON" -m benchmarks.perf.qlora "${qlora[@]}" --quants nf4 --output none --device "$DEVICE"
                "${files[@]}") ;;
    *) return 1 ;;
  esac
}

write_status() {  # phase status exit-code seconds limit [output-file]: $OUT/<phase>.json for a phase that did not
  # finish, with its partial figures and the end of its output (the error, if any)
  "$PYTHON" - "$OUT" "$@" <<'PY'
import json, os, sys
out, phase, status, code, seconds, limit = sys.argv[1:7]
def read(path, parse):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return parse(fh)
    except (OSError, ValueError):
        return None
partial = read(os.path.join(out, phase + ".partial.json"), json.load)
tail = read(sys.argv[7], lambda fh: fh.read()[-4000:]) if len(sys.argv) > 7 else None
path = os.path.join(out, phase + ".json")
with open(path + ".tmp", "w", encoding="utf-8") as fh:
    json.dump({"phase": phase, "status": status, "exit_code": int(code), "seconds": float(seconds),
               "limit_s": float(limit), "partial": partial, "output_tail": tail}, fh, indent=2)
os.replace(path + ".tmp", path)
PY
}

environment_text() {  # the GPU, memory and disk as the tools print them
  {
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    free -g; df -h "$CACHE" /tmp; nproc
  } >"$OUT/env.txt" 2>&1
}

run_phase() {  # phase: its command under timeout, with what is left of PHASE_LIMIT_S; 0 when it finished
  local name=$1 start=$SECONDS rc status output
  local left=$(( PHASE_LIMIT_S - SECONDS ))
  if [[ $name == smoke ]] && (( left > SMOKE_LIMIT_S )); then left=$SMOKE_LIMIT_S; fi
  rm -f "$OUT/$name.json" "$OUT/$name.partial.json"
  if (( left < MIN_PHASE_S )); then
    note "$name: skipped, ${left} s left of PHASE_LIMIT_S=$PHASE_LIMIT_S"
    write_status "$name" skipped 0 0 "$left"
    return 1
  fi
  if [[ $name == env ]]; then environment_text; else mkdir -p "$CACHE/$name"; fi
  phase_command "$name"
  note "$name: start, limit $left s: ${CMD[*]}"
  output=$(mktemp)  # this phase's output alone, for its status file
  timeout -k "$KILL_GRACE_S" "$left" "${CMD[@]}" 2>&1 | tee -a "$LOG" "$output"
  rc=${PIPESTATUS[0]}
  [[ $name == env ]] || rm -rf "${CACHE:?}/$name"  # spilled factors, the saved model: a killed run leaves them
  if (( rc == 124 || rc == 137 )); then status=timeout
  elif (( rc != 0 )); then status=failed
  elif [[ ! -s $OUT/$name.json ]]; then status=failed; rc=1  # finished without its result
  else status=done
  fi
  [[ $status == done ]] || write_status "$name" "$status" "$rc" "$(( SECONDS - start ))" "$left" "$output"
  rm -f "$output"
  note "$name: $status (exit status $rc) after $(( SECONDS - start )) s"
  [[ $status == done ]]
}

pack_bnb() {  # this venv's bitsandbytes, trimmed to its CUDA 13 library (the GPU image's torch is cu130)
  local src site=.whl/site
  src=$("$PYTHON" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("bitsandbytes").origin))') \
    || { echo "bitsandbytes is not installed here" >&2; return 1; }
  rm -rf "$site"/bitsandbytes "$site"/bitsandbytes-*.dist-info && mkdir -p "$site" || return 1
  cp -r "$src" "$(dirname "$src")"/bitsandbytes-*.dist-info "$site"/ || return 1
  find "$site/bitsandbytes" -name __pycache__ -prune -exec rm -rf {} +
  find "$site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name 'libbitsandbytes_cuda13*.so' \
    ! -name 'libbitsandbytes_cpu.so' -delete
  du -sh .whl
}

main() {
  (( $# )) || { usage; return 0; }
  if [[ $1 == pack-bnb ]]; then pack_bnb; return; fi
  local phase failed=0
  for phase in "$@"; do
    phase_command "$phase" || { usage >&2; echo "unknown phase: $phase" >&2; return 2; }
  done
  mkdir -p "$OUT" "$CACHE"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1
  [[ -d .whl/site ]] && export PYTHONPATH="$PWD/.whl/site:$PYTHONPATH"  # bitsandbytes carried by pack-bnb
  for phase in "$@"; do
    run_phase "$phase" || failed=1
  done
  return $failed
}

main "$@"
