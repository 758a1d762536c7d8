"""The QLoRA path (issue 21): a LoRA on a bitsandbytes nf4 base against the same LoRA on the same base in bf16.

One LLaMA-shaped model (random init, saved once), a LoRA on every linear layer with a fake fine-tune (random
``lora_B``), and the rectification ``JanusCallback`` runs at train end (``rectify_live_peft`` on the snapshot
``initial_state`` took), with the same forced schedule in both runs (τ=0: one Jacobian evaluation for θ0 and
one for the single step, so time per evaluation compares like for like). Each configuration runs in a fresh
subprocess, so that each peak RSS is its own. Recorded per run: the θ0 snapshot bytes, the peak host RSS
(kernel high-water mark), the peak GPU memory when on CUDA, and seconds per Jacobian evaluation.

Usage::

    python benchmarks/perf/qlora.py                 # CPU, ~2 min on an idle 2-core box
    python benchmarks/perf/qlora.py --quick         # smoke test
    python benchmarks/perf/qlora.py --size 7b       # LLaMA-2-7B shapes, m=256, T=512, on one CUDA GPU

Results: ``benchmarks/perf/results/qlora_<size>.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # hidden, intermediate, layers, heads, m, T
    "quick": (256, 512, 2, 4, 8, 32),
    "cpu": (1024, 2816, 4, 16, 32, 64),
    "7b": (4096, 11008, 32, 32, 256, 512),
}
RESULTS = Path(__file__).resolve().parent / "results"


def run_one(spec: dict) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_janus import JanusConfig
    from hf_janus.adapters.peft_layers import adapted_linear_layers, initial_state
    from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kwargs = {"dtype": torch.bfloat16, "device_map": device}
    if spec["quant"] == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(spec["path"], **kwargs)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    layers = adapted_linear_layers(model)
    initial = initial_state(layers)
    snapshot = sum(t.numel() * t.element_size() for t in initial.values())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fake fine-tune: the same random B in both runs
        for module in layers.values():
            b = module.lora_B["default"].weight
            b.copy_(0.01 * torch.randn(b.shape, generator=gen).to(b.dtype))
    replay = [{"input_ids": torch.randint(3, 32000, (spec["T"],), generator=gen).tolist()} for _ in range(spec["m"])]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run = rectify_live_peft(model, initial, replay, JanusConfig(tau=0.0, rank=32, replay_batch_size=8),
                            PeftOutput("adapter"), progress=False)
    seconds = time.perf_counter() - start
    evals = run.report.num_jacobian_evals
    return {
        "quant": spec["quant"], "device": device, "layers": len(layers), "snapshot_bytes": snapshot,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "seconds": seconds, "jacobian_evals": evals, "seconds_per_eval": seconds / evals,
        "replay_loss": dict(run.report.replay_loss),
    }


def save_model(size: str, path: str) -> None:
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
        model = model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    model.to(torch.bfloat16).save_pretrained(path)


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="cpu")
    ap.add_argument("--quick", action="store_true", help="same as --size quick")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    size = "quick" if args.quick else args.size
    _, _, _, _, m, T = SIZES[size]
    rows = []
    with tempfile.TemporaryDirectory(prefix="janus-qlora-") as tmp:
        save_model(size, tmp)
        for quant in ("bf16", "nf4"):
            spec = {"path": tmp, "quant": quant, "m": m, "T": T}
            out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                 text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            if out.returncode != 0:
                raise SystemExit(f"{quant} run failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    bf16, nf4 = rows
    print(f"QLoRA path, size={size} (m={m}, T={T}, LoRA r=16 on every linear layer, JANUS r=32), {bf16['device']}")
    print("| base | θ0 snapshot MiB | peak host RSS MiB | peak GPU MiB | rectification s / Jacobian evaluation |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['quant']} | {mib(row['snapshot_bytes'])} | {mib(row['peak_rss_bytes'])} | "
              f"{mib(row['peak_gpu_bytes'])} | {row['seconds_per_eval']:.2f} |")
    print(f"nf4 / bf16: snapshot {nf4['snapshot_bytes'] / bf16['snapshot_bytes']:.3f}, "
          f"time per evaluation {nf4['seconds_per_eval'] / bf16['seconds_per_eval']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    target = RESULTS / f"qlora_{size}.json"
    target.write_text(json.dumps({"size": size, "m": m, "T": T, "runs": rows}, indent=2) + "\n")
    print(f"written to {target}")


if __name__ == "__main__":
    main()
