"""What one Jacobian evaluation costs against a plain forward/backward (issue 16): R_eval and R, on the CPU and at 7B.

For each configuration, in a fresh process:

* **F**: one plain forward+backward over the whole replay with the weights frozen, no hooks, the same replay batch
  size and dtype (the backward runs through the activations, from ``inputs_embeds`` that require grad); the fastest
  of ``--f-passes`` passes (default two) after a warm-up batch.
* a rectification with a fixed schedule of ``--evals`` Jacobian evaluations (``measure.schedule``: the base
  capture, rejected and forced trials, the final unchecked step), timed per Rectifier step (capture, projection,
  comparison, statistics) by ``measure.Instrument``.
* ``R_eval = (capture + projection + comparison seconds) / (evaluations · F)``: what an evaluation costs in units
  of F; ``R = total seconds / (evaluations · F)``, set-up and statistics included.
* the peak host RSS, the peak GPU memory (``torch.cuda.max_memory_allocated``), and the memory plan's predictions.

``--baseline REV`` runs every configuration with the engine of git revision REV too, alternating, so that before and
after come from the same invocation. CPU sizes are LLaMA shapes of 20M, 60M and 130M parameters (vocab 32000).

``--gpu-7b`` runs the LLaMA-2-7B shape (random init, bf16, factors stored in bf16) at m=256, T=512, r=32 on the GPU
(``--device cpu`` with a small ``--size`` smoke-tests the path) and appends the run to ``results/scale_7b_gpu.json``
(or ``--out``): besides the figures above, the capture schedule (``captures`` and ``captures_alive`` planned,
``peak_captures`` held, ``recaptures``), the planned disk, seconds per evaluation, and the targets of issues 16/34
(R_eval ≤ 2, 4 evaluations in under 150 s, peak GPU ≤ 75 GiB) as ``targets`` with ``met`` computed from the run.
``--partial PATH`` rewrites the figures so far after each stage and Rectifier step (``measure.PartialJSON``),
so that a run killed at a device call's limit leaves them; ``benchmarks/perf/gpu_scale_session.sh`` drives these
runs on the GPU machine. ``--env PATH`` writes the environment (versions, GPU, memory, free disk) and stops.

Usage::

    python -m benchmarks.perf.scale --threads 2 --baseline 44b431f    # CPU before/after, ~15 min on 2 idle cores
    python -m benchmarks.perf.scale --quick                           # smoke test, ~1 min
    python -m benchmarks.perf.scale --gpu-7b --evals 4 --cache /scratch/janus   # one H100
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from benchmarks.perf import measure as pr

HERE = Path(__file__).resolve().parent

RESULTS = HERE / "results"
GIB = pr.GIB


def plain_pass_seconds(model: torch.nn.Module, replay: list[dict[str, list[int]]], batch_size: int,
                       passes: int = 2) -> float:
    """F: forward + backward through activations over the whole replay, weights frozen, no hooks; the fastest of
    ``passes`` after a warm-up batch."""
    device = next(model.parameters()).device
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    ids = torch.tensor([s["input_ids"] for s in replay], device=device)
    embed = model.get_input_embeddings()

    def one_pass(batches: list[torch.Tensor]) -> float:
        sync(device)
        start = time.perf_counter()
        for batch in batches:
            inputs = embed(batch).detach().requires_grad_(True)
            logits = model(inputs_embeds=inputs, use_cache=False).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                     reduction="sum")
            loss.backward()
        sync(device)
        return time.perf_counter() - start

    try:
        batches = list(ids.split(batch_size))
        one_pass(batches[:1])  # warm-up: allocator, kernels
        return min(one_pass(batches) for _ in range(max(1, passes)))
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in its own process: F, then the instrumented rectification. With ``spec["partial"]`` the
    figures so far are rewritten there at each stage and after each Rectifier step (a killed run leaves them)."""
    import hf_janus

    device = torch.device(spec.get("device", "cpu"))
    partial = pr.PartialJSON(spec.get("partial"), device, verbose=spec.get("verbose", False), spec=spec)
    partial.stop_on_sigterm()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = pr.build_llama(spec["size"], spec["seed"], device, getattr(torch, spec.get("dtype", "float32")))
    reference = pr.fake_finetune(model, spec["delta_scale"], spec["seed"] + 1,
                                 torch.device(spec.get("reference_device", device.type)))
    replay = pr.random_replay(spec["m"], spec["T"], spec["seed"] + 2)
    partial.stage("model built")
    f_seconds = plain_pass_seconds(model, replay, spec["batch_size"], spec.get("f_passes", 2))
    partial.stage("F measured", f_s=f_seconds)
    options: dict[str, Any] = {"factor_dtype": getattr(torch, spec["factor_dtype"])} if spec.get("factor_dtype") else {}
    schedule = pr.schedule(spec["evals"]) if spec["evals"] else {}  # 0: default settings, to convergence
    if spec.get("captures", "auto") != "auto":  # only then: an engine before issue 34 has no such field
        schedule["captures"] = spec["captures"]
    if spec.get("distill_steps"):  # the repair after JANUS, on new-task samples of random tokens
        schedule["distill_steps"] = spec["distill_steps"]
        options["new_task"] = pr.random_replay(spec.get("new_task_samples", 64), spec["T"], spec["seed"] + 3)
    config = hf_janus.JanusConfig(compression_rank=spec["r"], replay_batch_size=spec["batch_size"], seed=spec["seed"],
                                  cache=spec.get("cache", "memory"), **schedule)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    Rectifier = pr.engine_module("rectifier").Rectifier
    with pr.PeakRSS(interval_s=0.01) as mon, pr.OtherCpu() as cpu:
        start = time.perf_counter()
        rect = Rectifier(model, reference, replay, config, progress=False, **options)
        partial.rectifier = rect
        partial.stage("Rectifier set up", setup_s=time.perf_counter() - start)
        if spec.get("free_reference"):
            reference.clear()
        verbose = spec.get("verbose", False)
        with pr.Instrument(device, verbose=verbose, ops=False, on_section=partial.on_section) as inst:
            report = rect.run()
            report = getattr(report, "report", report)  # engines before issue 32 returned the report itself
        total = time.perf_counter() - start
    out = result_row(spec, report, inst, f_seconds, total, mon.peak, cpu.other_cores)
    out["peak_captures"] = getattr(getattr(rect, "store", None), "peak_captures", None)
    if device.type == "cuda":
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["device"] = torch.cuda.get_device_name(device)
    else:
        out["device"] = "cpu"
    out["targets"], out["met"] = TARGETS, targets_met(out)
    partial.stage("done", **{k: out[k] for k in ("total_s", "r_eval", "r", "met")})
    return out


def result_row(spec: dict[str, Any], report: Any, inst: "pr.Instrument", f_seconds: float, total: float,
               peak_rss: int, other_cores: float) -> dict[str, Any]:
    """A run's row: sections, R_eval and R, memory against the plan's prediction, and the capture schedule."""
    import hf_janus

    sections = {name: part["seconds"] for name, part in inst.as_dict().items()}
    evals = report.num_jacobian_evals
    per_eval = sections.get("capture", 0.0) + sections.get("project", 0.0) + sections.get("compare", 0.0)
    plan = pr.plan_figures(getattr(report, "memory_plan", None))
    return {
        **spec, "engine": os.path.dirname(hf_janus.__file__), "f_s": f_seconds, "evaluations": evals,
        "total_s": total, "seconds_per_eval": total / evals, "sections_s": sections,
        "timings": dict(report.timings), "r_eval": per_eval / (evals * f_seconds), "r": total / (evals * f_seconds),
        "recaptures": getattr(report, "recaptures", None), "converged": getattr(report, "converged", None),
        "stop_reason": getattr(report, "stop_reason", None), "peak_host_gib": peak_rss / GIB,
        "other_processes_cores": other_cores,
        "predicted_peak_host_gib": plan.get("predicted_peak_host_gib"),
        "predicted_peak_device_gib": plan.get("predicted_peak_device_gib"),
        "predicted_disk_gib": plan.get("predicted_disk_gib"), "placements": plan.get("placements"),
        "captures": plan.get("captures"), "captures_alive": plan.get("captures_alive"),
        "max_residual": max([layer.residual for layer in report.layers if layer.residual is not None], default=None),
    }


# The targets of issues 16 and 34 for the LLaMA-2-7B shape on one H100 (a smoke run's row carries them too).
TARGETS = {"r_eval_max": 2.0, "four_evaluations_max_s": 150.0, "peak_gpu_max_gib": 75.0}


def targets_met(row: dict[str, Any]) -> dict[str, Optional[bool]]:
    """Each target against the row's figures; None where it does not apply (not 4 evaluations, no GPU)."""
    peak = row.get("peak_gpu_gib")
    return {"r_eval": row["r_eval"] <= TARGETS["r_eval_max"],
            # the whole rectification, set-up included, of a run with exactly 4 evaluations
            "four_evaluations_s": (row["total_s"] < TARGETS["four_evaluations_max_s"]
                                   if row["evaluations"] == 4 else None),
            "peak_gpu_gib": None if peak is None else peak <= TARGETS["peak_gpu_max_gib"]}


def environment(cache: str) -> dict[str, Any]:
    """What the GPU session needs to know before it spends a device call: versions, the GPU, host memory, the free
    disk where factors spill, and whether bitsandbytes imports (the QLoRA phase; the GPU image may lack it)."""
    import importlib.metadata as metadata

    import psutil

    out: dict[str, Any] = {"machine": pr.machine_info(), "packages": {}}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "safetensors", "psutil"):
        try:
            out["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out["packages"][name] = None
    out["cuda"] = torch.cuda.is_available()
    out["bitsandbytes"] = bitsandbytes_check("cuda" if out["cuda"] else "cpu")
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_total_gib=props.total_memory / GIB, torch_cuda=torch.version.cuda)
    out["host_available_gib"] = psutil.virtual_memory().available / GIB
    os.makedirs(cache, exist_ok=True)
    out["cache"], out["cache_free_gib"] = cache, shutil.disk_usage(cache).free / GIB
    return out


def bitsandbytes_check(device: str) -> Any:
    """True when bitsandbytes imports and quantizes a small bf16 matrix to nf4 on ``device`` (what the QLoRA phase
    needs: its native library must match this CUDA); else the error, as text."""
    try:
        functional = importlib.import_module("bitsandbytes.functional")
        weights = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
        packed, state = functional.quantize_4bit(weights, quant_type="nf4")
        functional.dequantize_4bit(packed, state)
        return True
    except Exception as err:  # any failure (missing, no library for this CUDA) means the QLoRA phase cannot run
        return f"{type(err).__name__}: {err}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["config", "engine", "captures (most alive, recaptures)", "F s", "evals", "capture s", "projection s",
            "comparison s", "total s", "R_eval", "R", "peak RSS GiB", "predicted GiB", "other cores"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        s = row["sections_s"]
        predicted = row.get("predicted_peak_host_gib")
        lines.append("| " + " | ".join([
            f"{row['size']} m={row['m']} T={row['T']}", row["label"],
            f"{row.get('captures') or '-'} ({row.get('peak_captures') or '-'}, {row.get('recaptures') or 0})",
            f"{row['f_s']:.2f}", str(row["evaluations"]),
            f"{s.get('capture', 0):.1f}", f"{s.get('project', 0):.1f}", f"{s.get('compare', 0):.1f}",
            f"{row['total_s']:.1f}", f"{row['r_eval']:.1f}", f"{row['r']:.1f}", f"{row['peak_host_gib']:.2f}",
            "-" if predicted is None else f"{predicted:.2f}", f"{row['other_processes_cores']:.2f}"]) + " |")
    return "\n".join(lines)


GPU_ROW_KEYS = ("device", "size", "m", "T", "evals", "f_s", "f_passes", "r_eval", "r", "evaluations", "total_s",
                "seconds_per_eval", "sections_s", "peak_gpu_gib", "peak_host_gib", "predicted_peak_device_gib",
                "predicted_peak_host_gib", "predicted_disk_gib", "placements", "captures", "captures_alive",
                "peak_captures", "recaptures", "converged", "stop_reason", "targets", "met")


def write_gpu_rows(path: Path, rows: list[dict[str, Any]], command: str) -> None:
    """Append the --gpu-7b rows to ``path`` ({"status": "done", "runs": [...]}), atomically."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    runs = data if isinstance(data, list) else data.get("runs", [])  # a list: the format before issue 34
    runs += [{**{k: row.get(k) for k in GPU_ROW_KEYS}, "command": command, "engine": row["label"]} for row in rows]
    pr.write_json_atomic(path, {"status": "done", "runs": runs})


@contextlib.contextmanager
def maybe_engine(rev: Optional[str]) -> Iterator[Optional[str]]:
    if rev is None:
        yield None
        return
    with pr.engine_at(rev) as path:
        yield path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two tiny sizes, m=16, T=16 (a smoke test)")
    ap.add_argument("--baseline", metavar="REV", help="also run the engine of git revision REV (before/after)")
    ap.add_argument("--evals", type=int, default=4,
                    help="Jacobian evaluations per run (even; default 4); 0: default settings, run to convergence")
    ap.add_argument("--delta-scale", type=float, default=0.05,
                    help="synthetic fine-tune: W += scale·std(W)·N(0, 1) on every target weight (default 0.05)")
    ap.add_argument("--size", default="7B", help="--gpu-7b: the model shape (7B, or a CPU size such as 130M for a "
                                                  "smoke test)")
    ap.add_argument("--m", type=int, default=None, help="replay samples (default: 256 with --gpu-7b, else 32)")
    ap.add_argument("--T", type=int, default=None,
                    help="tokens per replay sample (default: 512 with --gpu-7b, else 64)")
    ap.add_argument("--sizes", default="20M,60M,130M", help="on the CPU: the model shapes (default: %(default)s)")
    ap.add_argument("--captures", default="auto", help="JanusConfig.captures; comma-separated runs each "
                                                       "configuration once per schedule (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gpu-7b", action="store_true", help="LLaMA-2-7B shape on the GPU (bf16, m=256, T=512, r=32)")
    ap.add_argument("--device", default="cuda", help="--gpu-7b: the device (cpu smoke-tests the path with a small "
                                                     "--size; default: %(default)s)")
    ap.add_argument("--f-passes", type=int, default=2, help="timed passes of F after the warm-up batch, the fastest "
                                                            "kept (default: %(default)s)")
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="--gpu-7b: the repair after JANUS (JanusConfig.distill_steps) on 64 new-task samples of "
                         "random tokens; its seconds are the 'repair' section (default: none)")
    ap.add_argument("--cache", default="memory", help="JanusConfig.cache (a directory lets factors spill to disk)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--partial", type=Path, default=None,
                    help="--gpu-7b: rewrite the figures so far here after each stage and Rectifier step")
    ap.add_argument("--env", type=Path, default=None, metavar="PATH",
                    help="write the environment (versions, GPU, host memory, free disk of --cache) here and stop")
    ap.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env:
        cache = tempfile.gettempdir() if args.cache == "memory" else os.path.abspath(args.cache)
        pr.write_json_atomic(args.env, {"status": "done", **environment(cache)})
        print(args.env.read_text(encoding="utf-8"))
        return 0
    if args._run:
        result = run_one(json.loads(Path(args._run).read_text(encoding="utf-8")))
        Path(args._result).write_text(json.dumps(result), encoding="utf-8")
        return 0
    command = "python -m benchmarks.perf.scale " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    # absolute paths: each run's process starts in a temporary directory (measure.launch)
    cache = args.cache if args.cache == "memory" else str(Path(args.cache).resolve())
    base = dict(seed=0, delta_scale=args.delta_scale, r=32, batch_size=8, evals=args.evals, cache=cache,
                f_passes=args.f_passes)
    if args.gpu_7b:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("--gpu-7b needs a CUDA device (none is visible); --device cpu smoke-tests the path")
        specs = [dict(base, size=args.size, m=args.m or 256, T=args.T or 512, device=args.device, dtype="bfloat16",
                      factor_dtype="bfloat16", reference_device="cpu", free_reference=True, verbose=True,
                      distill_steps=args.distill_steps,
                      partial=str(args.partial.resolve()) if args.partial else None)]
    elif args.quick:
        specs = [dict(base, size=s, m=16, T=16, threads=args.threads) for s in ("5M", "9M")]
    else:
        specs = [dict(base, size=s, m=args.m or 32, T=args.T or 64, threads=args.threads)
                 for s in args.sizes.split(",")]
    specs = [dict(spec, captures=c) for spec in specs for c in args.captures.split(",")]
    rows = []
    engines = [("current", None)] + ([(f"baseline {args.baseline}", args.baseline)] if args.baseline else [])
    for spec in specs:
        for label, rev in engines:
            with maybe_engine(rev) as path:
                row = pr.launch(spec, "benchmarks.perf.scale", engine_dir=path)
            row["label"] = label
            rows.append(row)
            print(f"{label:>20} {spec['size']}: F {row['f_s']:.2f} s, {row['evaluations']} evaluations, "
                  f"R_eval {row['r_eval']:.2f}, R {row['r']:.2f}, {row['total_s']:.1f} s", flush=True)
    print(table(rows))
    RESULTS.mkdir(exist_ok=True)
    if args.gpu_7b:
        path = args.out or RESULTS / "scale_7b_gpu.json"
        write_gpu_rows(path, rows, command)
    else:
        path = args.out or RESULTS / ("scale_cpu_quick.json" if args.quick else "scale_cpu.json")
        path.write_text(json.dumps({"command": command, "machine": pr.machine_info(), "runs": rows}, indent=2),
                        encoding="utf-8")
        path.with_suffix(".md").write_text(table(rows) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
