"""The self-replay cache key at 7B (issue 61): what hashing every weight byte costs against one generation of θ0's
answers.

The key (``hf_janus.replay.generation_cache.model_fingerprint``) reads every parameter and buffer once. Generating the
replay reads every weight at least once per decoding step. Both are measured on a LLaMA-2-7B-shaped model built
from a config (random bf16 weights, nothing downloaded) with two of its 32 decoder layers, and scaled to the 7B
model's bytes: both read each weight byte once, so both grow with the bytes (a decoding step of batch 8 is bound
by reading the weights). The generation is ``SelfReplay``'s default for given prompts: 256 samples in batches of 8,
64 new tokens each (2,048 decoding steps); prefill is left out, which only makes the generation look cheaper than
it is.

Usage::

    python -m benchmarks.perf.self_replay_key                 # CPU, a few minutes on 2 cores
    python -m benchmarks.perf.self_replay_key --device cuda   # one GPU

Result: ``benchmarks/perf/results/self_replay_key_<device>.json`` (or ``--out``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: LLaMA-2-7B's bf16 weights: embeddings and head (2 x 32000 x 4096), 32 decoder layers, the final norm
BYTES_7B = 2 * (2 * 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096)
SAMPLES, BATCH, NEW_TOKENS, PROMPT_TOKENS = 256, 8, 64, 32


def build(layers: int, device: str) -> Any:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device(device):
        model = tf.LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def best_of(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_step_seconds(model: Any, device: str, steps: int, sync) -> float:
    """Seconds per decoding step of a batch of 8 with a KV cache (the prefill timed apart and taken off)."""
    import torch

    ids = torch.randint(0, 32000, (BATCH, PROMPT_TOKENS), device=device)

    def run(new: int) -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    prefill = best_of(lambda: run(1), 2, sync)
    whole = best_of(lambda: run(steps + 1), 2, sync)
    return (whole - prefill) / steps


def measure(device: str, steps: int, repeats: int) -> dict[str, Any]:
    import torch

    from hf_janus.replay.generation_cache import weights_digest

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    model = build(2, device)
    measured = {"key_s": best_of(lambda: weights_digest(model), repeats, sync),
                "decode_step_s": decode_step_seconds(model, device, steps, sync),
                "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    scale = BYTES_7B / measured["bytes"]
    at_7b = {"key_s": measured["key_s"] * scale, "decode_step_s": measured["decode_step_s"] * scale,
             "bytes": BYTES_7B}
    decode_steps = (SAMPLES // BATCH) * NEW_TOKENS
    generation_s = decode_steps * at_7b["decode_step_s"]
    return {"device": device, "measured_2_layers": measured, "at_7b": at_7b,
            "generation_7b_s": generation_s, "decode_steps": decode_steps,
            "key_share_of_generation": at_7b["key_s"] / generation_s,
            "key_gb_per_s": at_7b["bytes"] / at_7b["key_s"] / 1e9}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8, help="decoding steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = measure(args.device, args.steps, args.repeats)
    result.update(command="python -m benchmarks.perf.self_replay_key " + " ".join(argv or []),
                  machine=platform.processor() or platform.machine(), torch=torch.__version__,
                  threads=torch.get_num_threads(), seconds=time.perf_counter() - started)
    kind = "gpu" if args.device.startswith("cuda") else "cpu"
    out = Path(args.out) if args.out else HERE / "results" / f"self_replay_key_{kind}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    at = result["at_7b"]
    print("| at LLaMA-2-7B shapes (bf16) | seconds |\n|---|---:|")
    print(f"| cache key (every weight byte, {at['bytes'] / 1e9:.1f} GB at {result['key_gb_per_s']:.1f} GB/s) "
          f"| {at['key_s']:.1f} |")
    print(f"| one decoding step, batch {BATCH} | {at['decode_step_s']:.2f} |")
    print(f"| one generation: {SAMPLES} samples x {NEW_TOKENS} new tokens ({result['decode_steps']} steps) "
          f"| {result['generation_7b_s']:.0f} |")
    print(f"\nkey / generation: {result['key_share_of_generation']:.2%}; written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
