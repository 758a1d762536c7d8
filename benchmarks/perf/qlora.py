"""The QLoRA path (issues 21 and 34): a LoRA on a bitsandbytes nf4 base against the same LoRA on the same base in bf16.

One LLaMA-shaped model (random init, built from its config and saved once: nothing is downloaded), a LoRA on every
linear layer with a fake fine-tune (random ``lora_B``), and the rectification ``JanusCallback`` runs at train end
(``rectify_live_peft`` on the snapshot ``initial_state`` took), with the same forced schedule in both runs (τ=0: one
Jacobian evaluation for θ0 and one for the single step, so time per evaluation compares like for like). Each
configuration runs in a fresh subprocess, so that each peak is its own. Recorded per run: the θ0 snapshot bytes, the
peak host RSS (kernel high-water mark), the peak GPU memory (``torch.cuda.max_memory_allocated``) when on CUDA,
seconds per Jacobian evaluation, the memory plan's predictions and the capture schedule; the result also holds the
target of issue 34 (nf4 at 7B: peak GPU ≤ 20 GiB) as ``targets`` and whether it was ``met``.

The saved model and the factors that spill go under ``--cache`` (at 7B: 13.5 GB of bf16 weights, and the factors
beyond host memory); both are deleted at the end. ``--partial PATH`` rewrites the figures so far after each stage
and Rectifier step (``measure.PartialJSON``), so that a run killed at a time limit still leaves them.

Usage::

    python -m benchmarks.perf.qlora                 # CPU, ~2 min on an idle 2-core box
    python -m benchmarks.perf.qlora --quick         # smoke test
    python -m benchmarks.perf.qlora --size 7b --quants nf4 --m 64 --cache /scratch \\
        --out /tmp/qlora.json --partial /tmp/qlora.partial.json   # one CUDA GPU (gpu_scale_session.sh qlora)

Results: ``benchmarks/perf/results/qlora_<size>.json`` (or ``--out``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent

SIZES = {  # hidden, intermediate, layers, heads, m, T
    "quick": (256, 512, 2, 4, 8, 32),
    "cpu": (1024, 2816, 4, 16, 32, 64),
    "7b": (4096, 11008, 32, 32, 256, 512),
}
QUANTS = ("bf16", "nf4")
RESULTS = HERE / "results"
# Issue 34: a QLoRA rectification of a 7B model on one GPU within 20 GiB of GPU memory (the nf4 run).
TARGETS = {"nf4_peak_gpu_max_gib": 20.0}


def load_model(spec: dict[str, Any]) -> Any:
    """The saved model on ``spec["device"]`` (nf4-quantized when asked) with a LoRA on every linear layer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": spec["device"]}
    if spec["quant"] == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(spec["path"], **kwargs)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in its own process; the figures so far go to ``spec["partial"]`` as they come."""
    import torch

    from benchmarks.perf import measure as pr
    from hf_janus import JanusConfig
    from hf_janus.adapters.live.rectify import LivePeftRun, PeftOutput, rectify_adapted_layers, rectify_live_peft
    from hf_janus.adapters.peft_layers import adapted_linear_layers, initial_state

    device = torch.device(spec["device"])
    partial = pr.PartialJSON(spec.get("partial"), device, verbose=True, spec=spec, completed_runs=spec.get("done"))
    partial.stop_on_sigterm()
    model = load_model(spec)
    layers = adapted_linear_layers(model)
    initial = initial_state(layers)
    snapshot = sum(t.numel() * t.element_size() for t in initial.values())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fake fine-tune: the same random B in both runs
        for module in layers.values():
            b = module.lora_B["default"].weight
            b.copy_(0.01 * torch.randn(b.shape, generator=gen).to(b.dtype))
    replay = [{"input_ids": torch.randint(3, 32000, (spec["T"],), generator=gen).tolist()} for _ in range(spec["m"])]
    partial.stage("model loaded", snapshot_bytes=snapshot, layers=len(layers))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if device.type == "cuda" and spec.get("device_memory_gib"):
        # a smaller card on a larger one: the allocator refuses beyond it, and the memory plan and the stand-ins'
        # placement measure the same limit
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["device_memory_gib"] * pr.GIB / total), device)
    config = JanusConfig(tau=0.0, compression_rank=spec.get("rank", 32), replay_batch_size=spec.get("batch_size", 8),
                         cache=spec["cache"])
    start = time.perf_counter()
    with pr.Instrument(device, verbose=True, ops=False, on_section=partial.on_section):
        if spec.get("output", "adapter") == "adapter":
            run = rectify_live_peft(model, initial, replay, config, PeftOutput("adapter"), progress=False)
        else:  # the rectification alone: at 7B the write-back's 224 float64 SVDs would not fit a device call
            rectifier = rectify_adapted_layers(model, layers, initial, replay, config, progress=False)
            run = LivePeftRun(rectifier.result.report, model, rectifier)
    out = run_row(spec, run, time.perf_counter() - start, len(layers), snapshot)
    partial.stage("done", seconds=out["seconds"])
    return out


def run_row(spec: dict[str, Any], run: Any, seconds: float, n_layers: int, snapshot: int) -> dict[str, Any]:
    """A finished run's figures: memory (measured and planned), time per evaluation, the capture schedule."""
    import torch

    from benchmarks.perf import measure as pr

    device = torch.device(spec["device"])
    evals = run.report.num_jacobian_evals
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    store = getattr(getattr(run, "rectifier", None), "store", None)
    return {
        "quant": spec["quant"], "device": spec["device"], "m": spec["m"], "T": spec["T"], "layers": n_layers,
        "rank": spec.get("rank", 32), "batch_size": spec.get("batch_size", 8), "output": spec.get("output", "adapter"),
        "device_memory_gib": spec.get("device_memory_gib"),
        "snapshot_bytes": snapshot, "peak_rss_bytes": pr.peak_host_bytes(), "peak_host_gib": pr.peak_host_gib(),
        "peak_gpu_bytes": peak_gpu,
        "peak_gpu_gib": None if peak_gpu is None else peak_gpu / pr.GIB,
        "seconds": seconds, "jacobian_evals": evals, "seconds_per_eval": seconds / evals,
        "recaptures": getattr(run.report, "recaptures", None),
        "peak_captures": getattr(store, "peak_captures", None),
        "replay_loss": dict(run.report.replay_loss), **pr.plan_figures(run.report.memory_plan),
    }


def save_model(size: str, path: str) -> None:
    """A random-init LLaMA of ``size``, in bf16, saved to ``path`` (built from its config: no download)."""
    import torch
    import transformers as tf

    hidden, inter, n_layers, heads, _, _ = SIZES[size]
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                            num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=heads,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta" if size == "7b" else "cpu"):
        model = tf.LlamaForCausalLM(config)
    if size == "7b":
        # allocated in bf16 straight away: 13.5 GB of host memory instead of 27 GB in float32 and a bf16 copy
        model = model.to(torch.bfloat16).to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    model.to(torch.bfloat16).save_pretrained(path)


def launch(spec: dict[str, Any]) -> dict[str, Any]:
    """``run_one(spec)`` in a fresh interpreter; its progress goes to stderr as it comes."""
    # from the repository root, where the benchmarks package is (the spec's paths are absolute)
    out = subprocess.run([sys.executable, "-m", "benchmarks.perf.qlora", "--one", json.dumps(spec)],
                         stdout=subprocess.PIPE, text=True, cwd=HERE.parents[1],
                         env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if out.returncode != 0:
        raise SystemExit(f"{spec['quant']} run failed (exit status {out.returncode}; its output is above)")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def summary(rows: list[dict[str, Any]], size: str, m: int, T: int) -> str:
    lines = [f"QLoRA path, size={size} (m={m}, T={T}, LoRA r=16 on every linear layer, JANUS r={rows[0]['rank']}, "
             f"replay batch {rows[0]['batch_size']}), {rows[0]['device']}",
             "| base | θ0 snapshot MiB | peak host RSS MiB | peak GPU MiB | rectification s / Jacobian evaluation |",
             "|---|---|---|---|---|"]
    lines += [f"| {row['quant']} | {mib(row['snapshot_bytes'])} | {mib(row['peak_rss_bytes'])} | "
              f"{mib(row['peak_gpu_bytes'])} | {row['seconds_per_eval']:.2f} |" for row in rows]
    by_quant = {row["quant"]: row for row in rows}
    if set(by_quant) == set(QUANTS):
        bf16, nf4 = by_quant["bf16"], by_quant["nf4"]
        lines.append(f"nf4 / bf16: snapshot {nf4['snapshot_bytes'] / bf16['snapshot_bytes']:.3f}, "
                     f"time per evaluation {nf4['seconds_per_eval'] / bf16['seconds_per_eval']:.2f}")
    return "\n".join(lines)


def targets_met(rows: list[dict[str, Any]]) -> dict[str, Optional[bool]]:
    """Issue 34's target against the nf4 run; None without one, or off a GPU."""
    nf4 = next((row for row in rows if row["quant"] == "nf4"), None)
    peak = None if nf4 is None else nf4["peak_gpu_gib"]
    return {"nf4_peak_gpu_gib": None if peak is None else peak <= TARGETS["nf4_peak_gpu_max_gib"]}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="cpu")
    ap.add_argument("--quick", action="store_true", help="same as --size quick")
    ap.add_argument("--quants", default=",".join(QUANTS),
                    help="comma-separated bases to run, of bf16 and nf4 (default: %(default)s)")
    ap.add_argument("--m", type=int, default=None, help="replay samples (default: the size's)")
    ap.add_argument("--T", type=int, default=None, help="tokens per replay sample (default: the size's)")
    ap.add_argument("--compression-rank", type=int, default=32, help="JANUS compression rank (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="replay batch size (default: %(default)s)")
    ap.add_argument("--device", default=None, help="default: cuda when one is visible, else cpu")
    ap.add_argument("--cache", default=None, help="directory for the saved model and JanusConfig.cache (factors "
                                                  "spill there; default: the system's temporary directory)")
    ap.add_argument("--device-memory-gib", type=float, default=None,
                    help="on CUDA, let the process use at most this much of the GPU (a 24 GB card: 20), as "
                         "torch.cuda.set_per_process_memory_fraction does (default: all of it)")
    ap.add_argument("--output", choices=["adapter", "none"], default="adapter",
                    help="adapter: the rectified update written back into the LoRA (what JanusCallback does); none: "
                         "the rectification only (at 7B the write-back would not fit a device call) "
                         "(default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default: results/qlora_<size>.json)")
    ap.add_argument("--partial", type=Path, default=None,
                    help="rewrite the figures so far here after each stage and Rectifier step")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.size = "quick" if args.quick else args.size
    args.quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    if not args.quants or set(args.quants) - set(QUANTS):
        ap.error(f"--quants takes {', '.join(QUANTS)}; got {args.quants}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    import torch

    from benchmarks.perf import measure as pr

    command = "python -m benchmarks.perf.qlora " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    _, _, _, _, m, T = SIZES[args.size]
    m, T = args.m or m, args.T or T
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cache = os.path.abspath(args.cache or tempfile.gettempdir())
    partial = str(args.partial.resolve()) if args.partial else None
    os.makedirs(cache, exist_ok=True)
    rows: list[dict[str, Any]] = []
    progress = pr.PartialJSON(partial, torch.device(device), verbose=True, size=args.size, m=m, T=T)
    with tempfile.TemporaryDirectory(prefix="janus-qlora-", dir=cache) as tmp:
        progress.stage("saving the model")
        save_model(args.size, tmp)
        progress.stage("model saved")
        for quant in args.quants:
            rows.append(launch({"path": tmp, "quant": quant, "m": m, "T": T, "rank": args.compression_rank,
                                "batch_size": args.batch_size, "device": device, "cache": cache,
                                "device_memory_gib": args.device_memory_gib,
                                "output": args.output, "partial": partial, "done": rows}))
    print(summary(rows, args.size, m, T))
    target = args.out or RESULTS / f"qlora_{args.size}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    pr.write_json_atomic(target, {"status": "done", "size": args.size, "m": m, "T": T, "command": command,
                                  "runs": rows, "targets": TARGETS, "met": targets_met(rows)})
    print(f"written to {target}")


if __name__ == "__main__":
    main()
