"""Benchmark of the JANUS ghost machinery (paper, App. B) on CPU.

Part A - ghost vs explicit projection on single GPT-2-small-shaped layers.
    For random per-sample factors X (m, T, d_in), A (m, T, d_out) and a random update ΔW it times and
    measures the peak memory of
      * explicit:      J (m x d_out*d_in) built with torch.func (vmap of grad of the per-sample linear
                       functional L_i(W) = Σ_t <a_it, W x_it>, whose gradient is A_iᵀ X_i), Gram J Jᵀ,
                       pinv and ΔW - Jᵀ (J Jᵀ)⁺ J ΔW, all in float64;
      * ghost_full:    hf_janus LayerJacobian(path="ghost") + eig_psd + project on the full T factors
                       (no compression: the same numbers as explicit, "equal error");
      * compress:      hf_janus compress_sequence to rank r (timed on its own);
      * ghost_r:       the ghost path on the rank-r factors (what the engine runs);
      * materialized_r: LayerJacobian(path="materialized") on the rank-r factors.
    Errors are measured against the exact (uncompressed) J.

Part B - end-to-end ``hf_janus.rectify`` wall time and peak RSS vs model size (random-init GPT-2
    models of ~10M/50M/125M parameters, a fake fine-tune, a random-token replay). Every size runs in a
    fresh subprocess so its peak RSS is its own.

Part C - model level, what the paper says the ghost path avoids: per-sample backpropagation and the
    instantiated J. A GPT-2-small-shaped model (n_embd 768, 12 heads) with ``--c-layers`` (2) blocks and a
    ``--c-vocab`` (8192) vocabulary, random init, θ0 = its state dict, θ̂ = θ0 + a small random perturbation
    of every target weight; m=64 random-token replay samples of T=128. Single-step JANUS at θ0 is computed
      * explicit: one forward+backward per sample (per-sample gradients = J row by row, stored float32),
                  float64 Gram, pinv and projection per layer;
      * by the engine: ``Rectifier.capture("c0")`` + ``StepLoop.project_all("c0")`` (one batched
                  capture, Gram, eigendecomposition, projection) with rank=None and the ghost path forced
                  (equal error), rank=None and the engine's path choice, and rank=r (the default).
    The projected updates are compared (equal error) and each one's residual is measured against the
    explicit J. Runs in its own process.

Run ``python benchmarks/bench_ghost.py`` (full: ~10 min on an idle 2-core machine) or ``--quick`` (smoke,
~1 min). ``--parts`` picks parts; parts not run are kept from an existing ``--out`` file. Timings are wall-clock; the CPU time other processes used meanwhile is recorded next to each one,
because on a shared machine a busy neighbour can slow small multi-threaded LAPACK calls by orders of
magnitude.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import torch
from torch import Tensor
from torch.func import grad, vmap

import hf_janus
from hf_janus.engine.compression import compress_sequence
from hf_janus.engine.ghost import LayerJacobian, choose_path, eig_psd, project
from hf_janus.engine.layers import rule_for

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "bench_ghost.json"
RCOND = 1e-10  # JanusConfig.gram_rcond default; the explicit pinv uses the same relative cutoff
MiB = 1 << 20

# GPT-2-small linear layers as (d_in, d_out): attn.c_proj, attn.c_attn, mlp.c_fc, mlp.c_proj.
GPT2_SHAPES = [(768, 768), (768, 2304), (768, 3072), (3072, 768)]
QUICK_SHAPES = [(128, 128), (128, 384), (128, 512), (512, 128)]

# Random-init GPT-2 models for part B: (n_embd, n_layer, n_head); vocab 50257 and 1024 positions as GPT-2.
MODEL_SIZES = {
    "10M": (160, 6, 5),
    "50M": (512, 8, 8),
    "125M": (768, 12, 12),  # GPT-2 small
    # --quick
    "3M": (64, 2, 2),
    "7M": (128, 2, 4),
}
FULL_SIZES = ["10M", "50M", "125M"]
QUICK_SIZES = ["3M", "7M"]

# ------------------------------------------------------------------------------------------------------
# Measurement helpers
# ------------------------------------------------------------------------------------------------------


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS so the next baseline RSS is honest.

    glibc keeps freed blocks below its dynamic mmap threshold (up to 32 MiB) in the heap; without the trim the
    pages of the previous measurement would sit in the baseline and be reused unseen. (Forcing every block
    into its own mapping with MALLOC_MMAP_THRESHOLD_ instead slowed LAPACK-heavy calls 5-10x here.)
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class PeakRSS:
    """Peak resident set size of this process while a block runs, sampled by a background thread.

    torch's CPU allocations are invisible to tracemalloc, so RSS is the only allocator-independent
    measure; ``delta`` is the peak over the RSS just before the block (after a GC and malloc_trim).
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _rss(self) -> int:
        return self._proc.memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> "PeakRSS":
        release_free_memory()
        self.baseline = self.peak = self._rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


class OtherCpu:
    """CPU time that *other* processes used while a block ran: this machine may be shared, and a busy
    neighbour inflates wall times (OpenMP threads wait for descheduled peers). Recorded next to every
    timing so a reader can tell a clean measurement from a contended one."""

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)

    @staticmethod
    def _own() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def __enter__(self) -> "OtherCpu":
        self._busy0, self._own0, self._wall0 = self._busy(), self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.own_cpu = self._own() - self._own0
        self.other_cpu = max(0.0, self._busy() - self._busy0 - self.own_cpu)

    @property
    def other_cores(self) -> float:
        """Mean number of cores busy with other processes during the block (kernel counters tick every
        10 ms, so this is only meaningful for blocks well above that; clipped to the core count)."""
        return min(self.other_cpu / self.wall, float(os.cpu_count() or 1)) if self.wall > 0 else 0.0


@dataclass
class Measured:
    value: Any
    seconds: float
    peak_delta_bytes: int
    other_cores: float  # mean cores used by other processes during the best call


def measure(fn: Callable[[], Any], repeats: int = 1) -> Measured:
    """Best wall time over ``repeats`` calls and the largest peak-RSS increase seen in any of them."""
    best, peak, other, value = float("inf"), 0, 0.0, None
    for _ in range(repeats):
        value = None  # drop the previous result so it does not sit in the next baseline
        with PeakRSS() as mon, OtherCpu() as cpu:
            start = time.perf_counter()
            value = fn()
            seconds = time.perf_counter() - start
        if seconds < best:
            best, other = seconds, cpu.other_cores
        peak = max(peak, mon.delta)
    return Measured(value, best, peak, other)


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu_model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    import transformers

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "transformers": transformers.__version__,
        "hf_janus": hf_janus.__version__,
    }


# ------------------------------------------------------------------------------------------------------
# Part A: one layer, ghost vs explicit
# ------------------------------------------------------------------------------------------------------


def explicit_jacobian(x: Tensor, a: Tensor) -> Tensor:
    """J (m x d_out*d_in) with torch.func, independent of the factor formulas under test.

    The per-sample loss L_i(W) = Σ_t <a_it, W x_it> is linear in W with output gradient a_it, so
    ∇_W L_i = A_iᵀ X_i is exactly the JANUS Jacobian row of sample i (rvec, (d_out, d_in) layout).
    """
    m, d_in, d_out = x.shape[0], x.shape[-1], a.shape[-1]
    w = torch.zeros(d_out, d_in, dtype=x.dtype)  # the functional is linear: the point does not matter

    def loss(w: Tensor, x_i: Tensor, a_i: Tensor) -> Tensor:
        return (a_i * (x_i @ w.T)).sum()

    return vmap(grad(loss), in_dims=(None, 0, 0))(w, x, a).reshape(m, -1)


def explicit_projection(x: Tensor, a: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """ΔW - Jᵀ (J Jᵀ)⁺ J ΔW with J materialized; float64 throughout, as the ghost path. Returns (proj, J)."""
    jac = explicit_jacobian(x.double(), a.double())
    flat = delta.double().reshape(-1)
    gram = jac @ jac.T
    coeff = torch.linalg.pinv(gram, rtol=RCOND, hermitian=True) @ (jac @ flat)
    proj = (flat - jac.T @ coeff).reshape(delta.shape)
    return proj, jac


def janus_projection(x: Tensor, a: Tensor, delta: Tensor, path: str) -> Tensor:
    """What the engine does per layer (StepLoop.project_all): Gram, eigendecomposition, projection."""
    jac = LayerJacobian(x, a, dtype=torch.float64, path=path)
    eig = eig_psd(jac.gram(), RCOND)
    proj = project(jac, delta, eig)
    jac.release()
    return proj


def rel(num: Tensor, den: Tensor) -> float:
    return float(torch.linalg.norm(num) / torch.linalg.norm(den))


def retained_energy(x_hat: Tensor, a_hat: Tensor, jac: Tensor) -> float:
    """Mean over samples of ||Â_iᵀ X̂_i||² / ||A_iᵀ X_i||²: how much of each gradient rank r keeps."""
    xh, ah = x_hat.double(), a_hat.double()
    compressed = ((ah @ ah.transpose(1, 2)) * (xh @ xh.transpose(1, 2))).sum(dim=(1, 2))
    exact = (jac * jac).sum(dim=1)
    return float((compressed / exact).mean())


def bench_layer(d_in: int, d_out: int, m: int, T: int, r: int, repeats: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, T, d_in, generator=gen)
    a = torch.randn(m, T, d_out, generator=gen)
    delta = 0.02 * torch.randn(d_out, d_in, generator=gen)

    explicit = measure(lambda: explicit_projection(x, a, delta), repeats)
    proj_e, jac = explicit.value
    explicit.value = None
    # rank=None keeps all T rows: the engine's exact, uncompressed setting.
    ghost_full = measure(lambda: janus_projection(*compress_sequence(x, a, None), delta, "ghost"), repeats)
    compress = measure(lambda: compress_sequence(x, a, r), repeats)
    x_hat, a_hat = compress.value
    ghost_r = measure(lambda: janus_projection(x_hat, a_hat, delta, "ghost"), repeats)
    mat_r = measure(lambda: janus_projection(x_hat, a_hat, delta, "materialized"), repeats)

    # Errors, always against the exact J (float64, uncompressed).
    jd = jac @ delta.double().reshape(-1)

    def errors(proj: Tensor) -> dict[str, float]:
        return {
            "residual": rel(jac @ proj.reshape(-1), jd),  # ||J ΔW_proj|| / ||J ΔW||
            "proj_rel_diff_vs_explicit": rel(proj - proj_e, proj_e),
            # ΔW_proj ≈ ΔW (m rows remove a tiny part of d_out*d_in dims), so also compare the removed part.
            "correction_rel_diff_vs_explicit": rel(proj - proj_e, delta.double() - proj_e),
        }

    row = {
        "d_in": d_in, "d_out": d_out, "m": m, "T": T, "r": r,
        "engine_auto_path_at_r": choose_path(m, r, d_in, d_out, 8, 1 << 30),
        "explicit_J_bytes": m * d_in * d_out * 8,
        "seconds": {
            "explicit": explicit.seconds, "ghost_full": ghost_full.seconds, "compress": compress.seconds,
            "ghost_r": ghost_r.seconds, "materialized_r": mat_r.seconds,
        },
        "peak_delta_bytes": {
            "explicit": explicit.peak_delta_bytes, "ghost_full": ghost_full.peak_delta_bytes,
            "compress": compress.peak_delta_bytes, "ghost_r": ghost_r.peak_delta_bytes,
            "materialized_r": mat_r.peak_delta_bytes,
        },
        "other_processes_cores": {
            "explicit": explicit.other_cores, "ghost_full": ghost_full.other_cores, "compress": compress.other_cores,
            "ghost_r": ghost_r.other_cores, "materialized_r": mat_r.other_cores,
        },
        "errors": {
            "explicit": errors(proj_e), "ghost_full": errors(ghost_full.value),
            "ghost_r": errors(ghost_r.value), "materialized_r": errors(mat_r.value),
        },
        "compression_retained_energy": retained_energy(x_hat, a_hat, jac),
    }
    s, p = row["seconds"], row["peak_delta_bytes"]
    row["ratios"] = {
        "time_explicit_over_ghost_full": s["explicit"] / s["ghost_full"],
        "time_explicit_over_ghost_r": s["explicit"] / s["ghost_r"],
        "time_explicit_over_compress_plus_ghost_r": s["explicit"] / (s["compress"] + s["ghost_r"]),
        "mem_explicit_over_ghost_full": p["explicit"] / max(p["ghost_full"], 1),
        "mem_explicit_over_ghost_r": p["explicit"] / max(p["ghost_r"], 1),
        "mem_explicit_over_max_compress_ghost_r": p["explicit"] / max(p["compress"], p["ghost_r"], 1),
    }
    return row


def run_part_a(args: argparse.Namespace) -> dict[str, Any]:
    shapes = args.shapes or (QUICK_SHAPES if args.quick else GPT2_SHAPES)
    m, T, r = args.a_m, args.a_T, args.a_r
    # Warm-up on a tiny layer: thread pools, LAPACK and torch.func initialisation stay out of the timings.
    bench_layer(32, 48, 4, 8, 2, 1, seed=123)
    rows = []
    for i, (d_in, d_out) in enumerate(shapes):
        start = time.perf_counter()
        rows.append(bench_layer(d_in, d_out, m, T, r, args.repeats, seed=args.seed + i))
        print(f"[part A] {d_in}x{d_out}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return {
        "settings": {"m": m, "T": T, "r": r, "repeats": args.repeats, "dtype_inputs": "float32",
                     "dtype_products": "float64", "rcond": RCOND, "shapes": shapes},
        "memory_method": (
            "peak process RSS sampled every 5 ms by a psutil thread during the call, minus the RSS just before "
            "it (after gc + malloc_trim, so freed pages of earlier calls are not in the baseline). Includes the "
            "call's float64 copies of its inputs and its output; blocks freed and reused inside the call count once."
        ),
        "time_method": f"best wall time of {args.repeats} call(s), torch threads = {torch.get_num_threads()}",
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------------
# Part B: end-to-end rectification vs model size
# ------------------------------------------------------------------------------------------------------


def build_model(size: str, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_embd, n_layer, n_head = MODEL_SIZES[size]
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    return GPT2LMHeadModel(config).eval()


def fake_finetune(model: torch.nn.Module, scale: float, seed: int) -> dict[str, Tensor]:
    """Perturb every target weight by ``scale * std(W) * N(0, 1)``; return θ0 of the targets (state dict)."""
    targets = hf_janus.resolve_target_modules(model)
    reference = {name + ".weight": module.weight.detach().clone() for name, module in targets.items()}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in targets.values():
            w = module.weight
            w.add_(scale * float(w.std()) * torch.randn(w.shape, generator=gen))
    return reference


def random_replay(m: int, T: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (T,), generator=gen).tolist()} for _ in range(m)]


def run_single_model(args: argparse.Namespace, size: str) -> dict[str, Any]:
    """One model size, meant to run in its own process (see run_part_b)."""
    model = build_model(size, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    targets = hf_janus.resolve_target_modules(model)
    target_params = sum(mod.weight.numel() for mod in targets.values())
    reference = fake_finetune(model, args.delta_scale, args.seed + 1)
    replay = random_replay(args.b_m, args.b_T, model.config.vocab_size, args.seed + 2)
    config = hf_janus.JanusConfig(rank=args.b_r, tau=args.tau, max_steps=args.max_steps,
                                  replay_batch_size=args.batch_size, seed=args.seed)
    with PeakRSS(interval_s=0.005) as mon, OtherCpu() as cpu:
        start = time.perf_counter()
        report = hf_janus.rectify(model, reference, replay, config, progress=False)
        wall = time.perf_counter() - start
    timings = dict(report.timings)
    phases = ("forward_backward", "compression", "ghost", "io")
    # "other": inside Rectifier.run but in no phase (weight writes, bookkeeping); "setup": rectify() before
    # run() starts its clock (replay collation, target resolution, θ0/backup copies).
    timings["other"] = timings.get("total", wall) - sum(timings.get(k, 0.0) for k in phases)
    timings["setup"] = wall - timings.get("total", wall)
    return {
        "size": size,
        "arch": dict(zip(("n_embd", "n_layer", "n_head"), MODEL_SIZES[size])),
        "params": n_params,
        "target_layers": len(targets),
        "target_params": target_params,
        "m": args.b_m, "T": args.b_T, "r": args.b_r, "tau": args.tau, "max_steps": args.max_steps,
        "replay_batch_size": args.batch_size,
        **run_figures(report, wall, cpu, mon),
        "num_steps": len(report.steps),
        "converged": report.converged,
        "timings": timings,
    }


def run_figures(report: Any, wall: float, cpu: "OtherCpu", mon: "PeakRSS") -> dict[str, Any]:
    """What every rectification benchmark row reports: time, CPU, memory, evaluations, paths, residual, losses."""
    paths = [layer.path for layer in report.layers]
    residuals = [layer.residual for layer in report.layers if layer.residual is not None]
    return {
        "wall_seconds": wall,
        "cpu_seconds": cpu.own_cpu,
        "other_processes_cores": cpu.other_cores,
        "rss_baseline_bytes": mon.baseline,
        "rss_peak_bytes": mon.peak,
        "rss_peak_delta_bytes": mon.delta,
        # Kernel high-water mark of the whole process (model build included): catches spikes between samples.
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "num_jacobian_evals": report.num_jacobian_evals,
        "num_trials": report.num_trials,
        "alphas": report.alphas,
        "layer_paths": {p: paths.count(p) for p in sorted(set(paths))},
        "max_residual": max(residuals) if residuals else None,
        "replay_loss": report.replay_loss,
    }


def run_subprocess(flag_args: list[str]) -> dict[str, Any]:
    """Re-invoke this script for an isolated measurement; the child writes its JSON to a temp file."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *flag_args, "--_result", result]
        subprocess.run(cmd, check=True)
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)


def common_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--seed", str(args.seed), "--repeats", str(args.repeats),
             "--a-m", str(args.a_m), "--a-T", str(args.a_T), "--a-r", str(args.a_r),
             "--b-m", str(args.b_m), "--b-T", str(args.b_T), "--b-r", str(args.b_r),
             "--tau", str(args.tau), "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
             "--delta-scale", str(args.delta_scale),
             "--c-layers", str(args.c_layers), "--c-vocab", str(args.c_vocab), "--c-m", str(args.c_m),
             "--c-T", str(args.c_T), "--c-r", str(args.c_r)]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.shapes:
        flags += ["--shapes", ",".join(f"{i}x{o}" for i, o in args.shapes)]
    return flags + (["--quick"] if args.quick else [])


def run_part_b(args: argparse.Namespace) -> dict[str, Any]:
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    rows = []
    for size in sizes:
        start = time.perf_counter()
        rows.append(run_subprocess(common_flags(args) + ["--_single-model", size]))
        print(f"[part B] {size}: {time.perf_counter() - start:.1f}s (incl. process start)", file=sys.stderr,
              flush=True)
    return {
        "settings": {"m": args.b_m, "T": args.b_T, "r": args.b_r, "tau": args.tau, "max_steps": args.max_steps,
                     "replay_batch_size": args.batch_size, "delta_scale": args.delta_scale,
                     "model": "random-init GPT2LMHeadModel, vocab 50257, 1024 positions, all-linear targets",
                     "replay": "random token ids, no padding"},
        "memory_method": ("peak RSS of a fresh process per model (psutil thread, 5 ms) during rectify(); "
                          "baseline = RSS after building the model, θ0 copy and replay; default glibc malloc"),
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------------
# Part C: model level, per-sample backprop ("explicit") vs the engine's capture + projection ("ghost")
# ------------------------------------------------------------------------------------------------------

# GPT-2-small-shaped blocks for part C: (n_embd, n_head); the block count and vocab are flags.
C_ARCH = (768, 12)
C_ARCH_QUICK = (128, 4)


def build_part_c_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_embd, n_head = C_ARCH_QUICK if args.quick else C_ARCH
    torch.manual_seed(args.seed)
    config = GPT2Config(n_embd=n_embd, n_head=n_head, n_layer=args.c_layers, vocab_size=args.c_vocab,
                        n_positions=max(128, args.c_T), bos_token_id=args.c_vocab - 1, eos_token_id=args.c_vocab - 1)
    return GPT2LMHeadModel(config).eval()


def _replay_batch(sample: dict[str, list[int]]) -> dict[str, Tensor]:
    ids = torch.tensor(sample["input_ids"], dtype=torch.long)[None]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def explicit_model_projection(model: torch.nn.Module, weights: dict[str, Tensor], deltas: dict[str, Tensor],
                              batches: list[dict[str, Tensor]]) -> dict[str, Any]:
    """Single-step JANUS the naive way, with the model at θ0: one forward + backward of sample i's
    token-summed loss per sample (``autograd.grad`` w.r.t. the target weights only, every other parameter
    frozen) gives row i of every layer's J; rows are stored float32 (as backprop yields them) in one
    preallocated (m, numel) tensor per layer; then per layer J -> float64, Gram J Jᵀ, pinv (relative cutoff
    RCOND, as the engine's eigen-cutoff) and ΔW - Jᵀ (J Jᵀ)⁺ J ΔW. Weights, ΔW and J rows are in the
    module's stored layout (Conv1D: (d_in, d_out)); the projection does not depend on the layout."""
    from hf_janus.engine.capture import token_summed_loss

    names, params = list(weights), list(weights.values())
    m = len(batches)
    start = time.perf_counter()
    jac = {name: torch.empty(m, w.numel(), dtype=torch.float32) for name, w in weights.items()}
    for i, batch in enumerate(batches):
        loss, _, _ = token_summed_loss(model, batch, i)
        grads = torch.autograd.grad(loss.sum(), params)
        for name, g in zip(names, grads):
            jac[name][i] = g.reshape(-1)
        del grads, loss
    backprop_seconds = time.perf_counter() - start
    projs = {}
    for name in names:
        j64 = jac[name].double()
        flat = deltas[name].double().reshape(-1)
        gram = j64 @ j64.T
        coeff = torch.linalg.pinv(gram, rtol=RCOND, hermitian=True) @ (j64 @ flat)
        projs[name] = (flat - j64.T @ coeff).reshape(deltas[name].shape)
        del j64
    return {"jac": jac, "proj": projs, "backprop_seconds": backprop_seconds,
            "linalg_seconds": time.perf_counter() - start - backprop_seconds}


def ghost_model_projection(model: torch.nn.Module, theta0: dict[str, Tensor], replay: list[dict[str, list[int]]],
                           config: "hf_janus.JanusConfig") -> dict[str, Any]:
    """The engine's part of single-step JANUS that corresponds to the explicit computation: Rectifier's
    ``capture("c0")`` (one batched forward/backward per replay batch at θ0, hooks record X and A, compressed
    to rank r unless rank=None) and its step loop's ``project_all("c0")`` (Gram, eigendecomposition, projection of
    every layer, on the path LayerJacobian picks). Not timed: Rectifier() (replay collation, weight copies) and
    ``layers.rewrite_current()`` (writes θ0 into the model), as the explicit side's θ0 load; not run at all: the
    fine-tuned replay loss, the trial capture at θ0 + ΔW_proj, the orientation comparison and the per-layer
    statistics that ``rectify`` adds. The float64 projections used for the error check are recomputed from
    the same factors and eigendecompositions after the timed block (the engine keeps them as float32)."""
    from hf_janus.engine.rectifier import Rectifier

    rect = Rectifier(model, theta0, replay, config, progress=False)
    loop = rect.make_loop()
    rect.layers.rewrite_current()

    def timed() -> None:
        rect.capture("c0")
        loop.project_all("c0")

    try:
        res = measure(timed, 1)
        phases = {k: v for k, v in rect.timer.seconds.items()}
        proj64, proj32, paths = {}, {}, {}
        for layer in rect.layers:
            jac = rect.jacobians.jacobian(layer.name, "c0")
            proj64[layer.name] = project(jac, layer.finetuned(layer.current.device) - layer.current, layer.eig)
            proj32[layer.name] = layer.proj
            paths[layer.name] = layer.path
            jac.release()
    finally:
        rect.layers.restore()
        rect.store.close()
    return {"measured": res, "phases": phases, "proj": proj64, "proj_engine_float32": proj32, "paths": paths}


def run_part_c(args: argparse.Namespace) -> dict[str, Any]:
    """Part C worker (own process, see main): builds the model and runs every method once."""
    from hf_janus.engine.rectifier import Rectifier

    model = build_part_c_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fake_finetune(model, args.delta_scale, args.seed + 1)
    theta_hat = {k: v.detach().clone() for k, v in model.state_dict().items()}
    targets = hf_janus.resolve_target_modules(model)
    rules = {name: rule_for(mod) for name, mod in targets.items()}
    stored_delta = {name: (theta_hat[name + ".weight"] - theta0[name + ".weight"]) for name in targets}
    replay = random_replay(args.c_m, args.c_T, args.c_vocab, args.seed + 2)
    batches = [_replay_batch(s) for s in replay]
    m, T, r = args.c_m, args.c_T, args.c_r
    target_params = sum(mod.weight.numel() for mod in targets.values())

    # Warm-up (untimed): thread pools, autograd, QR/SVD/eigh/pinv initialisation.
    for p in model.parameters():
        p.requires_grad_(False)
    model.load_state_dict(theta0)
    weights = {name: mod.weight for name, mod in targets.items()}
    for w in weights.values():
        w.requires_grad_(True)
    explicit_model_projection(model, weights, stored_delta, batches[:2])
    for w in weights.values():
        w.requires_grad_(False)
    model.load_state_dict(theta_hat)
    warm = Rectifier(model, theta0, replay[:4], hf_janus.JanusConfig(rank=min(r, 4), tau=0.0, replay_batch_size=4),
                     progress=False)
    warm.layers.rewrite_current()
    warm.capture("c0")
    warm.make_loop().project_all("c0")
    warm.layers.restore()
    warm.store.close()
    del warm

    # Ghost variants first, so the explicit J (m x all target weights) is not resident while they run.
    base = dict(tau=0.0, replay_batch_size=args.batch_size, seed=args.seed)
    variants = {
        "ghost_T": ("rank=None, materialize_max_bytes=0: all T rows, ghost path forced (equal error)",
                    hf_janus.JanusConfig(rank=None, materialize_max_bytes=0, **base)),
        "auto_T": ("rank=None, default materialize_max_bytes: all T rows, engine's path choice (equal error)",
                   hf_janus.JanusConfig(rank=None, **base)),
        "auto_r": (f"rank={r}, default materialize_max_bytes: the engine's default compression and path choice",
                   hf_janus.JanusConfig(rank=r, **base)),
    }
    ghost_runs = {}
    for key, (_, config) in variants.items():
        start = time.perf_counter()
        ghost_runs[key] = ghost_model_projection(model, theta0, replay, config)
        print(f"[part C] {key}: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)

    # Explicit, with the model at θ0 and only the target weights requiring grad.
    model.load_state_dict(theta0)
    for w in weights.values():
        w.requires_grad_(True)
    start = time.perf_counter()
    explicit = measure(lambda: explicit_model_projection(model, weights, stored_delta, batches), 1)
    print(f"[part C] explicit: {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    for w in weights.values():
        w.requires_grad_(False)
    model.load_state_dict(theta_hat)
    jac, proj_e = explicit.value["jac"], explicit.value["proj"]

    # Errors per layer, in the stored layout, against the explicit J (rows cast to float64 in chunks).
    def jmul(name: str, flat: Tensor) -> Tensor:
        return torch.cat([jac[name][i:i + 8].double() @ flat for i in range(0, m, 8)])

    def layer_errors(name: str, proj_stored: Tensor) -> dict[str, float]:
        delta = stored_delta[name].double()
        pe = proj_e[name]
        return {
            "residual": rel(jmul(name, proj_stored.reshape(-1)), jmul(name, delta.reshape(-1))),
            "proj_rel_diff_vs_explicit": rel(proj_stored - pe, pe),
            "correction_rel_diff_vs_explicit": rel(proj_stored - pe, delta - pe),
        }

    def summarize(per_layer: dict[str, dict[str, float]]) -> dict[str, float]:
        keys = next(iter(per_layer.values())).keys()
        return {f"max_{k}": max(v[k] for v in per_layer.values()) for k in keys}

    errors = {"explicit": {name: layer_errors(name, proj_e[name]) for name in targets}}
    for key, run in ghost_runs.items():
        errors[key] = {name: layer_errors(name, rules[name].from_matrix(run["proj"][name]).double())
                       for name in targets}
        errors[key + "_engine_float32"] = {
            name: layer_errors(name, rules[name].from_matrix(run["proj_engine_float32"][name]).double())
            for name in targets}

    methods: dict[str, Any] = {
        "explicit": {
            "what": ("per-sample backprop at θ0 (m forward+backward passes), J stored float32, "
                     "float64 Gram + pinv + projection per layer"),
            "seconds": explicit.seconds,
            "phases": {"per_sample_backprop": explicit.value["backprop_seconds"],
                       "gram_pinv_projection": explicit.value["linalg_seconds"]},
            "peak_delta_bytes": explicit.peak_delta_bytes,
            "other_processes_cores": explicit.other_cores,
            "layer_paths": {"explicit": len(targets)},
            "errors": summarize(errors["explicit"]),
        }
    }
    for key, run in ghost_runs.items():
        meas, ph = run["measured"], run["phases"]
        paths = list(run["paths"].values())
        methods[key] = {
            "what": variants[key][0],
            "config": variants[key][1].to_dict(),
            "seconds": meas.seconds,
            "phases": {"forward_backward": ph.get("forward_backward", 0.0), "compression": ph.get("compression", 0.0),
                       "ghost": ph.get("ghost", 0.0)},
            "peak_delta_bytes": meas.peak_delta_bytes,
            "other_processes_cores": meas.other_cores,
            "layer_paths": {p: paths.count(p) for p in sorted(set(paths))},
            "errors": summarize(errors[key]),
            "errors_engine_float32_output": summarize(errors[key + "_engine_float32"]),
        }
        methods[key]["ratios"] = {
            "time_explicit_over_this": explicit.seconds / meas.seconds,
            "mem_explicit_over_this": explicit.peak_delta_bytes / max(meas.peak_delta_bytes, 1),
        }
    n_embd, n_head = C_ARCH_QUICK if args.quick else C_ARCH
    return {
        "settings": {
            "m": m, "T": T, "r": r, "replay_batch_size": args.batch_size, "delta_scale": args.delta_scale,
            "model": (f"random-init GPT2LMHeadModel, n_embd={n_embd}, n_head={n_head}, n_layer={args.c_layers}, "
                      f"vocab {args.c_vocab}, {max(128, T)} positions; targets: every c_attn, attn.c_proj, c_fc, "
                      "mlp.c_proj weight"),
            "params": n_params, "target_layers": len(targets), "target_params": target_params,
            "explicit_J_bytes_float32": m * target_params * 4,
            "replay": "random token ids, no padding",
            "fine_tune": f"W += {args.delta_scale}·std(W)·N(0,1) on every target weight; θ0 = the full state dict",
            "rcond": RCOND,
            "repeats": 1,
        },
        "time_method": ("one wall-clock run per method after an untimed warm-up (per-sample backprop on 2 samples, "
                        f"a 4-sample rectifier capture + projection), torch threads = {torch.get_num_threads()}"),
        "memory_method": ("peak RSS of the part C process (psutil thread, 5 ms) during the timed block minus the RSS "
                          "just before it (after gc + malloc_trim); includes what the block returns/keeps (explicit: "
                          "the stored J; ghost: the captured factors in the FactorStore)"),
        "error_method": ("against the explicit (per-sample backprop) J: residual = ‖J ΔW_proj‖/‖J ΔW‖ per layer; "
                         "ΔW_proj and correction (ΔW − ΔW_proj) relative differences to the explicit projection; "
                         "max over layers. Ghost errors use the engine's float64 projection recomputed from the "
                         "same factors; errors_engine_float32_output uses the float32 layer.proj the engine keeps"),
        "methods": methods,
        "per_layer_errors": errors,
        "layer_names": list(targets),
    }


# ------------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------------


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def part_a_tables(part: dict[str, Any]) -> str:
    st = part["settings"]
    head = (f"### Part A - one layer, m={st['m']}, T={st['T']}, r={st['r']} "
            f"(float32 inputs, float64 products, best of {st['repeats']})\n\n")
    time_rows, mem_rows, err_rows = [], [], []
    for row in part["rows"]:
        shape = f"{row['d_in']}x{row['d_out']}"
        s, p, q, e = row["seconds"], row["peak_delta_bytes"], row["ratios"], row["errors"]
        time_rows.append([
            shape, f"{s['explicit']:.2f}", f"{s['ghost_full']:.2f}", f"{s['compress']:.2f}", f"{s['ghost_r']:.2f}",
            f"{s['materialized_r']:.2f}", f"{q['time_explicit_over_ghost_full']:.2f}x",
            f"{q['time_explicit_over_ghost_r']:.2f}x", f"{q['time_explicit_over_compress_plus_ghost_r']:.2f}x",
            row["engine_auto_path_at_r"], f"{max(row['other_processes_cores'].values()):.2f}",
        ])
        mem_rows.append([
            shape, mib(row["explicit_J_bytes"]), mib(p["explicit"]), mib(p["ghost_full"]), mib(p["compress"]),
            mib(p["ghost_r"]), mib(p["materialized_r"]), f"{q['mem_explicit_over_ghost_full']:.1f}x",
            f"{q['mem_explicit_over_ghost_r']:.1f}x",
        ])
        err_rows.append([
            shape, f"{e['explicit']['residual']:.1e}", f"{e['ghost_full']['residual']:.1e}",
            f"{e['ghost_r']['residual']:.3f}", f"{e['materialized_r']['residual']:.3f}",
            f"{e['ghost_full']['proj_rel_diff_vs_explicit']:.1e}",
            f"{e['ghost_full']['correction_rel_diff_vs_explicit']:.1e}",
            f"{e['ghost_r']['proj_rel_diff_vs_explicit']:.1e}",
            f"{e['ghost_r']['correction_rel_diff_vs_explicit']:.2f}",
            f"{row['compression_retained_energy']:.3f}",
        ])
    t = md_table(["d_in x d_out", "explicit s", f"ghost T={st['T']} s", f"compress r={st['r']} s",
                  f"ghost r={st['r']} s", f"materialized r={st['r']} s", "explicit / ghost T (equal error)",
                  "explicit / ghost r", "explicit / (compress + ghost r)", "engine auto path at r",
                  "max cores busy with other processes"], time_rows)
    mm = md_table(["d_in x d_out", "size of J MiB", "explicit MiB", f"ghost T={st['T']} MiB",
                   "compress MiB", f"ghost r={st['r']} MiB", f"materialized r={st['r']} MiB",
                   "explicit / ghost T", "explicit / ghost r"], mem_rows)
    ee = md_table(["d_in x d_out", "residual explicit", "residual ghost T", "residual ghost r",
                   "residual materialized r", "ghost T vs explicit: ΔW_proj rel diff",
                   "ghost T vs explicit: correction rel diff", "ghost r vs explicit: ΔW_proj rel diff",
                   "ghost r vs explicit: correction rel diff", "energy kept by rank r"], err_rows)
    notes = (
        "residual = ‖J ΔW_proj‖/‖J ΔW‖ with the exact (uncompressed) J; correction = ΔW − ΔW_proj "
        "(the part the projection removes); memory = peak RSS increase during the call (MiB).\n"
    )
    return (head + "Time (seconds) and speed-up of ghost over explicit\n\n" + t
            + "\n\nPeak memory (MiB above the pre-call RSS)\n\n" + mm
            + "\n\nError\n\n" + ee + "\n\n" + notes)


def part_b_table(part: dict[str, Any]) -> str:
    st = part["settings"]
    head = (f"### Part B - hf_janus.rectify on random-init GPT-2, m={st['m']}, T={st['T']}, r={st['r']}, "
            f"tau={st['tau']}, max_steps={st['max_steps']}, replay batch {st['replay_batch_size']}\n\n")
    rows = []
    for row in part["rows"]:
        t = row["timings"]
        paths = ", ".join(f"{v} {k}" for k, v in row["layer_paths"].items())
        rows.append([
            row["size"], f"{row['params']:,}", f"{row['target_layers']} ({row['target_params'] / 1e6:.1f}M)",
            f"{row['wall_seconds']:.1f}", mib(row["rss_peak_bytes"]), mib(row["rss_peak_delta_bytes"]),
            str(row["num_jacobian_evals"]), f"{t.get('forward_backward', 0):.2f}", f"{t.get('compression', 0):.2f}",
            f"{t.get('ghost', 0):.2f}", f"{t.get('io', 0):.2f}", f"{t['other']:.2f}", f"{t['setup']:.2f}",
            f"{t.get('total', 0):.2f}",
            paths, f"{row['other_processes_cores']:.2f}",
        ])
    notes = ("\nPhases are `report.timings` (total = Rectifier.run); setup = rectify() before run() starts "
             "(replay collation, weight copies), so wall = setup + total. Peak RSS is the whole process "
             "(model, θ0 copy, replay included); RSS increase is over the RSS just before rectify().\n")
    return head + md_table(
        ["model", "params", "target layers (weights)", "wall s", "peak RSS MiB", "RSS increase MiB",
         "Jacobian evals", "fwd+bwd s", "compression s", "ghost s", "io s", "other s", "setup s", "total s",
         "layer paths",
         "cores busy with other processes"],
        rows) + "\n" + notes


C_LABELS = {
    "explicit": "explicit (per-sample backprop, J stored)",
    "ghost_T": "ghost T, forced (equal error)",
    "auto_T": "engine auto path, T (equal error)",
    "auto_r": "engine default, r={r} (compressed)",
}


def part_c_table(part: dict[str, Any]) -> str:
    st = part["settings"]
    head = (f"### Part C - model level, single-step projection at θ0: {st['model'].split(';')[0]} "
            f"({st['params'] / 1e6:.1f}M params, {st['target_layers']} target layers, "
            f"{st['target_params'] / 1e6:.1f}M target weights), m={st['m']}, T={st['T']}, r={st['r']}, replay batch "
            f"{st['replay_batch_size']}, one run per method\n\n")
    time_rows, err_rows = [], []
    for key, row in part["methods"].items():
        label = C_LABELS.get(key, key).format(r=st["r"])
        ph, e = row["phases"], row["errors"]
        paths = ", ".join(f"{v} {k}" for k, v in row["layer_paths"].items())
        if key == "explicit":
            split = f"backprop {ph['per_sample_backprop']:.2f} / linalg {ph['gram_pinv_projection']:.2f}"
            ratio_t = ratio_m = "1x"
        else:
            split = (f"fwd+bwd {ph['forward_backward']:.2f} / compr. {ph['compression']:.2f} / "
                     f"ghost {ph['ghost']:.2f}")
            ratio_t = f"{row['ratios']['time_explicit_over_this']:.2f}x"
            ratio_m = f"{row['ratios']['mem_explicit_over_this']:.1f}x"
        time_rows.append([label, paths, f"{row['seconds']:.1f}", split, mib(row["peak_delta_bytes"]), ratio_t, ratio_m,
                          f"{row['other_processes_cores']:.2f}"])
        err_rows.append([label, f"{e['max_residual']:.1e}", f"{e['max_proj_rel_diff_vs_explicit']:.1e}",
                         f"{e['max_correction_rel_diff_vs_explicit']:.1e}"])
    t = md_table(["method", "layer paths", "time s", "split s", "peak RSS increase MiB", "time explicit / this",
                  "memory explicit / this", "cores busy with other processes"], time_rows)
    ee = md_table(["method", "max residual ‖J ΔW_proj‖/‖J ΔW‖", "max ΔW_proj rel diff vs explicit",
                   "max correction rel diff vs explicit"], err_rows)
    notes = (f"\nTimed: explicit = m per-sample forward+backward passes filling J (float32, "
             f"{mib(st['explicit_J_bytes_float32'])} MiB for all layers) + per layer float64 Gram, pinv, projection; "
             "ghost rows = `Rectifier.capture(\"c0\")` + `StepLoop.project_all(\"c0\")` (batched capture at θ0, "
             "Gram, eigendecomposition, projection), i.e. without the trial capture, orientation comparison and "
             "statistics that `rectify()` adds. Errors: max over layers, against the explicit J; ghost projections "
             "recomputed in float64 from the same factors (the engine keeps float32).\n")
    return head + t + "\n\n" + ee + "\n" + notes


# ------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]  # type: ignore
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must look like 768x768,768x3072; got {text!r}") from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke configuration (< 1 minute)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="JSON output; the tables go next to it as .md (default: benchmarks/results/bench_ghost.json)")
    ap.add_argument("--parts", default="ABC",
                    help="which parts to run, any of A, B, C (default: %(default)s); parts not run are kept from an "
                         "existing --out file written with the same --quick setting, unless --fresh")
    ap.add_argument("--fresh", action="store_true", help="do not keep parts from an existing --out file")
    ap.add_argument("--seed", type=int, default=0, help="seed of all random data (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="part A: timed calls per method, the best is kept (default: %(default)s)")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="part A layer shapes as d_inxd_out,... (default: 768x768,768x2304,768x3072,3072x768)")
    ap.add_argument("--a-m", type=int, default=None, help="part A samples m (default: 64; quick 16)")
    ap.add_argument("--a-T", type=int, default=None, help="part A sequence length T (default: 128; quick 32)")
    ap.add_argument("--a-r", type=int, default=None, help="part A compression rank r (default: 32; quick 8)")
    ap.add_argument("--sizes", nargs="+", choices=list(MODEL_SIZES),
                    help=f"part B model sizes (default: {' '.join(FULL_SIZES)}; quick {' '.join(QUICK_SIZES)})")
    ap.add_argument("--b-m", type=int, default=None, help="part B replay samples m (default: 32; quick 8)")
    ap.add_argument("--b-T", type=int, default=None, help="part B replay length T (default: 64; quick 16)")
    ap.add_argument("--b-r", type=int, default=None, help="part B rank r (default: 32; quick 8)")
    ap.add_argument("--tau", type=float, default=0.0,
                    help="part B JANUS tau; 0 = single step, 2 Jacobian evaluations (default: %(default)s)")
    ap.add_argument("--max-steps", type=int, default=10, help="part B JanusConfig.max_steps (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8, help="part B replay_batch_size (default: %(default)s)")
    ap.add_argument("--delta-scale", type=float, default=0.05,
                    help="part B fake fine-tune: ΔW = scale * std(W) * N(0, 1) on every target weight "
                         "(default: %(default)s)")
    ap.add_argument("--c-layers", type=int, default=None,
                    help="part C transformer blocks of the GPT-2-small-shaped model (default: 2; quick 1)")
    ap.add_argument("--c-vocab", type=int, default=None, help="part C vocabulary size (default: 8192; quick 1024)")
    ap.add_argument("--c-m", type=int, default=None, help="part C replay samples m (default: 64; quick 8)")
    ap.add_argument("--c-T", type=int, default=None, help="part C replay length T (default: 128; quick 16)")
    ap.add_argument("--c-r", type=int, default=None, help="part C rank r of the compressed run (default: 32; quick 8)")
    ap.add_argument("--_part-a", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_part-c", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_single-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.parts or set(args.parts.upper()) - set("ABC"):
        ap.error(f"--parts takes letters from A, B, C; got {args.parts!r}")
    defaults = {"a_m": (64, 16), "a_T": (128, 32), "a_r": (32, 8), "b_m": (32, 8), "b_T": (64, 16), "b_r": (32, 8),
                "c_layers": (2, 1), "c_vocab": (8192, 1024), "c_m": (64, 8), "c_T": (128, 16), "c_r": (32, 8)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    return args


PART_KEYS = {"A": "part_a", "B": "part_b", "C": "part_c"}


def load_previous(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Earlier results at ``path`` whose parts this run does not redo are kept (same --quick setting only)."""
    if args.fresh or not path.exists():
        return {}
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if bool(previous.get("args", {}).get("quick")) != bool(args.quick):
        print(f"not merging {path}: it was written with a different --quick setting", file=sys.stderr)
        return {}
    return previous


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    # Hidden worker modes: one isolated measurement, result to --_result.
    if args._part_a or args._part_c or args._single_model:
        if args._part_a:
            result = run_part_a(args)
        elif args._part_c:
            result = run_part_c(args)
        else:
            result = run_single_model(args, args._single_model)
        with open(args._result, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        return

    parts = args.parts.upper()
    previous = load_previous(args.out, args)
    out: dict[str, Any] = {"machine": machine_info(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                              for k, v in vars(args).items() if not k.startswith("_")}}
    runners = {
        "A": lambda: run_subprocess(common_flags(args) + ["--_part-a"]),
        "B": lambda: run_part_b(args),
        "C": lambda: run_subprocess(common_flags(args) + ["--_part-c"]),
    }
    with OtherCpu() as overall:
        for letter, key in PART_KEYS.items():
            if letter not in parts:
                continue
            with OtherCpu() as cpu:
                out[key] = runners[letter]()
            # Per part, so that a file merged from several invocations still says when and how cleanly each ran.
            out[key]["run"] = {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": cpu.wall,
                               "other_processes_mean_cores": cpu.other_cores, "args": out["args"]}
            print(f"[part {letter}] done in {cpu.wall:.0f}s, other processes {cpu.other_cores:.2f} cores",
                  file=sys.stderr, flush=True)
    kept = []
    for letter, key in PART_KEYS.items():
        if letter not in parts and key in previous:
            out[key] = previous[key]
            kept.append(letter)
    out["parts_run"] = [letter for letter in PART_KEYS if letter in parts]
    out["parts_kept_from_previous_file"] = kept
    out["total_seconds"] = overall.wall
    out["other_processes_cpu_seconds"] = overall.other_cpu
    out["other_processes_mean_cores"] = overall.other_cores

    tables = []
    for key, render in (("part_a", part_a_tables), ("part_b", part_b_table), ("part_c", part_c_table)):
        if key in out:
            tables.append(render(out[key]))
            print(tables[-1], flush=True)
    footer = (f"Machine: {out['machine']['cpu_model']}, {out['machine']['cpu_count_logical']} CPUs, torch "
              f"{out['machine']['torch']} ({out['machine']['torch_threads']} threads). This invocation ran part(s) "
              f"{', '.join(out['parts_run'])} in {out['total_seconds']:.0f} s; other processes kept "
              f"{out['other_processes_mean_cores']:.2f} of the cores busy on average (shared machine: timings taken "
              f"while they ran are inflated).")
    for letter in kept:
        run = out[PART_KEYS[letter]].get("run")
        footer += (f" Part {letter} kept from the previous file" + (
            f" (run {run['finished']}, {run['seconds']:.0f} s, other processes {run['other_processes_mean_cores']:.2f}"
            " cores)." if run else "."))
    footer += "\n"
    print(footer)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text("\n".join(tables) + "\n" + footer, encoding="utf-8")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
