"""Exact vs randomized sequence compression on one device, at LLaMA-2-7B layer shapes (issue 7).

For each shape (B=8 samples, T=512, r=32; the (d_in, d_out) of q/k/v/o, gate/up and down projections) it
times one ``compress_sequence`` call per method (CUDA events, median of repeats after a warm-up) and
measures the randomized result's error against the exact rank-r optimum, ‖G − Ĝ‖_F / ‖G − G_r‖_F per
sample (1 = optimal), on random factors (flat spectra: the hard case) and on factors with a decaying
spectrum. Prints a table and writes JSON.

    python -m benchmarks.perf.compression_gpu [--device cuda] [--out results/compression_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.perf.measure import md_table
from hf_janus.engine.compression import compress_sequence

HERE = Path(__file__).resolve().parent

SHAPES = {"q/k/v/o": (4096, 4096), "gate/up": (4096, 11008), "down": (11008, 4096)}


def factors(B: int, T: int, d_in: int, d_out: int, decay: bool, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, d_in, device=device, generator=gen)
    a = torch.randn(B, T, d_out, device=device, generator=gen)
    if decay:  # token weights 1/sqrt(t+1): singular values fall off like a real layer's
        w = (torch.arange(T, device=device) + 1.0).rsqrt().view(1, T, 1)
        x, a = x * w, a * w
    return x, a


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def excess_error(x, a, x_hat, a_hat, x_opt, a_opt, samples: int) -> list[float]:
    out = []
    for i in range(samples):
        g = a[i].double().T @ x[i].double()
        err = (g - a_hat[i].double().T @ x_hat[i].double()).norm()
        opt = (g - a_opt[i].double().T @ x_opt[i].double()).norm()
        out.append(float(err / opt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "compression_gpu.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        for decay in (False, True):
            x, a = factors(args.B, args.T, d_in, d_out, decay, device, seed=len(rows))
            exact = timed(lambda: compress_sequence(x, a, args.r, method="exact"), device, max(1, args.repeats // 2))
            randomized = timed(lambda: compress_sequence(x, a, args.r, method="randomized"), device, args.repeats)
            x_opt, a_opt = compress_sequence(x, a, args.r, method="exact")
            x_hat, a_hat = compress_sequence(x, a, args.r, method="randomized")
            ratios = excess_error(x, a, x_hat, a_hat, x_opt, a_opt, samples=min(2, args.B))
            rows.append(dict(layer=name, d_in=d_in, d_out=d_out, spectrum="decaying" if decay else "flat",
                             exact_s=exact, randomized_s=randomized, speedup=exact / randomized,
                             max_excess_error=max(ratios)))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"B={args.B} samples, T={args.T}, r={args.r}, {gpu}, torch {torch.__version__}\n")
    print(md_table(["layer (d_in x d_out)", "spectrum", "exact s", "randomized s", "speed-up",
                    "randomized error / optimal"],
                   [[f"{r['layer']} ({r['d_in']} x {r['d_out']})", r["spectrum"], f"{r['exact_s']:.3f}",
                     f"{r['randomized_s']:.4f}", f"{r['speedup']:.0f}x", f"{r['max_excess_error']:.4f}"]
                    for r in rows]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
