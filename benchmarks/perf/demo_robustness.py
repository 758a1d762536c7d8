"""Does ``hf-janus demo`` converge on any CPU? Run it over seeds, torch thread counts and ATen's CPU kernel
selection, and count how many runs end with both rectifications converged within the evaluation budget and the
time budget (issue 41 item 5).

    python -m benchmarks.perf.demo_robustness --seeds 0,1,2,3,4 --threads 1,2
    python -m benchmarks.perf.demo_robustness --seeds 0,1 --threads 2 --kernels aten-default,mkl-sse42

Each run is its own process (the thread counts and kernel selections are read from the environment at start-up),
run one at a time so that timings are those of an otherwise idle machine. Kernel selections (``--kernels``):
``native`` (what the machine picks), ``aten-default`` (``ATEN_CPU_CAPABILITY=default``: ATen's non-vectorized
kernels instead of its AVX2/AVX-512 ones) and ``mkl-sse42`` (``MKL_ENABLE_INSTRUCTIONS=SSE4_2``: MKL's SSE code
path for the matrix products): other roundings of the same sums, as another CPU would give.
Results: ``results/demo_robustness.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# What one run reports, from the demo's public API (hf_janus.demo.run_demo), as one JSON line on stdout.
_RUN = """
import json, sys, time
import torch
from hf_janus.demo import run_demo
torch.set_num_threads({threads})
result = run_demo(seed={seed}, quick={quick}, progress=False)
def facts(report):
    return {{"evals": report.num_jacobian_evals, "converged": report.converged, "steps": len(report.steps),
             "stop_reason": report.stop_reason}}
print("RESULT " + json.dumps({{"full": facts(result.report), "lora": facts(result.lora_report),
                              "seconds": result.seconds, "phase_seconds": result.phase_seconds,
                              "table": result.table, "torch_threads": torch.get_num_threads()}}))
"""


KERNELS = {"native": {}, "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
           "mkl-sse42": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}


def run_one(seed: int, threads: int, kernels: str, quick: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE",
               **KERNELS[kernels])
    code = _RUN.format(seed=seed, threads=threads, quick=quick)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the demo failed (seed {seed}, {threads} threads, {kernels}):\n{out.stderr[-3000:]}")
    row = json.loads(lines[-1][len("RESULT "):])
    row.update(seed=seed, threads=threads, kernels=kernels, process_seconds=wall)
    return row


def verdict(row: dict, max_evals: int) -> bool:
    """Both rectifications converged, within ``max_evals`` Jacobian evaluations together (the time is judged
    apart: only the default thread count is the demo's)."""
    both = row["full"]["converged"] and row["lora"]["converged"]
    return both and row["full"]["evals"] + row["lora"]["evals"] <= max_evals


def markdown(record: dict) -> str:
    rows = ["| seed | threads | kernels | full FT evals | LoRA evals | both converged | total evals | seconds | ok |",
            "|---:|---:|---|---:|---:|---|---:|---:|---|"]
    for r in record["runs"]:
        both = r["full"]["converged"] and r["lora"]["converged"]
        rows.append(f"| {r['seed']} | {r['threads']} | {r['kernels']} | {r['full']['evals']} | "
                    f"{r['lora']['evals']} | {'yes' if both else 'no'} | {r['full']['evals'] + r['lora']['evals']} | "
                    f"{r['seconds']:.0f} | {'✓' if r['ok'] else '✗'} |")
    s = record["summary"]
    rows.append("")
    rows.append(f"{s['ok']} of {s['runs']} runs converged, both rectifications, in ≤ {s['max_evals']} evaluations "
                f"together; evaluations {s['evals_min']}-{s['evals_max']} (median {s['evals_median']}).")
    for threads, t in sorted(s["seconds_by_threads"].items()):
        rows.append(f"With {threads} thread(s): {t['min']:.0f}-{t['max']:.0f} s, {t['within']} of {t['runs']} "
                    f"runs within {s['max_seconds']:.0f} s.")
    return "\n".join(rows)


def summarize(runs: list[dict], max_evals: int, max_seconds: float) -> dict:
    for row in runs:
        row["ok"] = verdict(row, max_evals)
    evals = sorted(r["full"]["evals"] + r["lora"]["evals"] for r in runs)
    by_threads: dict[str, dict] = {}
    for threads in sorted({r["threads"] for r in runs}):
        seconds = [r["seconds"] for r in runs if r["threads"] == threads]
        by_threads[str(threads)] = {"runs": len(seconds), "min": min(seconds), "max": max(seconds),
                                    "within": sum(t <= max_seconds for t in seconds)}
    return {"runs": len(runs), "ok": sum(r["ok"] for r in runs), "max_evals": max_evals, "max_seconds": max_seconds,
            "evals_min": evals[0], "evals_max": evals[-1], "evals_median": evals[len(evals) // 2],
            "seconds_by_threads": by_threads}


def write(record: dict, out: str) -> str:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json.tmp", "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
    os.replace(out + ".json.tmp", out + ".json")
    text = markdown(record)
    with open(out + ".md", "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kernels", default="native", help="comma-separated: " + ", ".join(KERNELS))
    ap.add_argument("--quick", action="store_true", help="the demo's --quick variant")
    ap.add_argument("--max-evals", type=int, default=90)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "demo_robustness"))
    ap.add_argument("--append", action="store_true", help="add these runs to those already in --out's JSON")
    args = ap.parse_args()
    runs = []
    if args.append and os.path.isfile(args.out + ".json"):
        with open(args.out + ".json", encoding="utf-8") as fh:
            runs = json.load(fh)["runs"]
    for kernels in args.kernels.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                row = run_one(seed, threads, kernels, args.quick)
                runs.append(row)
                print(f"seed {seed} threads {threads} {kernels}: full {row['full']['evals']} "
                      f"({'converged' if row['full']['converged'] else 'not converged'}), lora {row['lora']['evals']} "
                      f"({'converged' if row['lora']['converged'] else 'not converged'}), {row['seconds']:.0f}s",
                      flush=True)
    record = {"runs": runs, "quick": args.quick, "summary": summarize(runs, args.max_evals, args.max_seconds),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()}}
    print(write(record, args.out))


if __name__ == "__main__":
    main()
