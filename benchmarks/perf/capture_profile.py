"""Where one Jacobian capture's time goes (issue 65): a capture of the LLaMA shapes of ``scale.py`` timed by phase and
profiled by operation, on the GPU (or, smoke-testing the path, the CPU).

For each ``SIZE:M`` of ``--sizes`` (bf16 weights, factors stored in bf16 in host memory, r=32, replay batch 8), in
this process:

* **F**: one plain forward/backward over the replay (``scale.plain_pass_seconds``, one pass after a warm-up batch);
* three captures through the public ``Rectifier.capture``: ``first`` (fresh host buffers), ``profiled`` (the first
  still held, so its host buffers are fresh too; under ``torch.profiler`` with CPU and CUDA activities), and, after
  both are dropped, ``reused`` (the host allocator's cached blocks). Each one's wall seconds and its forward/backward
  and compression seconds as the engine's own timer splits them;
* of the profiled capture: the operations by self device time and by self host time (tables and the top rows), the
  engine's steps as annotated ranges (``begin_compression``, the Ritz steps, the factor store's puts, the hooks), and
  counts that say whether the hot path waits on the device: kernel launches, synchronizations, page-locked host
  allocations, device-to-host copies;
* **host copies** of one batch's factors of the widest layer: a fresh page-locked allocation, a copy into a page-locked
  buffer allocated beforehand, and a copy into pageable memory (seconds per piece).

Writes ``--out`` (JSON, rewritten after each size, so a run cut at a device call's limit keeps the sizes done) and
``--text`` (the tables). ``benchmarks/perf/gpu_scale_session.sh profile`` runs it on the GPU machine.

Usage::

    python -m benchmarks.perf.capture_profile --sizes 130M:32,7B:16 --T 512 --out profile.json --text profile.txt
    python -m benchmarks.perf.capture_profile --device cpu --sizes 5M:8 --T 16 --out /tmp/p.json   # smoke test
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import hf_janus
from benchmarks.perf import measure as pr
from benchmarks.perf.scale import plain_pass_seconds, sync

# The engine's steps inside a capture, shown as ranges in the profile: (engine module, attribute, label)
ANNOTATED = [
    ("capture", "_LayerRecorder.forward_hook", "janus: forward hook"),
    ("capture", "_LayerRecorder._on_grad", "janus: gradient hook"),
    ("capture", "begin_compression", "janus: begin_compression"),
    ("stacked_compression", "Stacks.flush", "janus: stacked compressions"),
    ("stacked_compression", "begin_compression", "janus: begin_compression (stacked)"),
    ("capture", "finish_all", "janus: finish_all (Ritz steps)"),
    ("capture", "merge_calls", "janus: merge_calls"),
    ("capture", "_check_finite", "janus: check finite"),
    ("store", "FactorStore.append", "janus: store append"),
    ("store", "FactorStore._to_host", "janus: store to host"),
    ("capture", "token_summed_loss", "janus: loss"),
]

# Host-side calls counted in the profile: a name containing the key counts
COUNTED = {
    "kernel_launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"),
    "synchronizations": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
    "pinned_allocations": ("cudaHostAlloc", "cudaMallocHost"),
    "device_allocations": ("cudaMalloc",),
    "memcpy_calls": ("cudaMemcpyAsync", "cudaMemcpy"),
    "device_to_host_copies": ("Memcpy DtoH",),
}


def annotate(module_name: str, attr: str, label: str) -> Optional[Callable[[], None]]:
    """Wrap an engine function so that its calls show as a ``record_function`` range; returns the undo (None when
    this engine has no such function)."""
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return original(*args, **kwargs)
        return inner

    return pr.wrap_engine(module_name, attr, make)


def _self_device_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)


def _device_us(event: Any) -> float:
    return float(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) or 0.0)


def summarize(prof: Any, rows: int) -> dict[str, Any]:
    """The profile's figures: totals, counts and the top operations (seconds)."""
    events = prof.key_averages()
    counts = {key: sum(e.count for e in events if any(n in e.key for n in names)) for key, names in COUNTED.items()}
    host_call_s = {key: sum(e.self_cpu_time_total for e in events if any(n in e.key for n in names)) / 1e6
                   for key, names in COUNTED.items()}

    def row(e: Any) -> dict[str, Any]:
        return {"name": e.key, "count": e.count, "self_device_s": _self_device_us(e) / 1e6,
                "self_host_s": e.self_cpu_time_total / 1e6, "host_total_s": e.cpu_time_total / 1e6,
                "device_total_s": _device_us(e) / 1e6}

    by_device = sorted(events, key=_self_device_us, reverse=True)[:rows]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    annotated = [row(e) for e in events if e.key.startswith("janus: ")]
    return {"device_busy_s": sum(_self_device_us(e) for e in events) / 1e6,
            "host_self_s": sum(e.self_cpu_time_total for e in events) / 1e6,
            "counts": counts, "host_call_s": host_call_s, "annotated": annotated,
            "top_by_device": [row(e) for e in by_device], "top_by_host": [row(e) for e in by_host]}


def tables(prof: Any, rows: int, device: torch.device) -> str:
    events = prof.key_averages()
    out = []
    if device.type == "cuda":
        out.append(events.table(sort_by="self_cuda_time_total", row_limit=rows))
    out.append(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n\n".join(out)


def timed_capture(rect: Any, tag: str, device: torch.device) -> dict[str, float]:
    """One capture's wall seconds and the engine timer's split of it."""
    before = dict(rect.timer.seconds)
    sync(device)
    start = time.perf_counter()
    rect.capture(tag)
    sync(device)
    wall = time.perf_counter() - start
    rect.timer.settle()
    after = rect.timer.seconds
    return {"wall_s": wall, **{f"{k}_s": after.get(k, 0.0) - before.get(k, 0.0)
                               for k in ("forward_backward", "compression")}}


def host_copies(shape: tuple[int, ...], device: torch.device, repeats: int = 8) -> dict[str, float]:
    """Seconds per piece of ``shape`` (bf16) going to the host three ways."""
    if device.type != "cuda":
        return {}
    piece = torch.randn(shape, device=device).to(torch.bfloat16)
    held = []

    def timed(fn: Callable[[], Any]) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            held.append(fn())
        sync(device)
        return (time.perf_counter() - start) / repeats

    fresh_pinned = timed(lambda: torch.empty(shape, dtype=piece.dtype, pin_memory=True).copy_(piece, non_blocking=True))
    buffers = [torch.empty(shape, dtype=piece.dtype, pin_memory=True) for _ in range(repeats)]
    it = iter(buffers)
    preallocated = timed(lambda: next(it).copy_(piece, non_blocking=True))
    pageable = timed(lambda: piece.cpu())
    held.clear()
    return {"shape": list(shape), "bytes": piece.nbytes, "fresh_pinned_s": fresh_pinned,
            "preallocated_pinned_s": preallocated, "pageable_s": pageable}


def profile_size(size: str, m: int, T: int, device: torch.device, cache: str, rows: int) -> tuple[dict, str]:
    Rectifier = pr.engine_module("rectifier").Rectifier
    model = pr.build_llama(size, 0, device, torch.bfloat16)
    reference = pr.fake_finetune(model, 0.05, 1, torch.device("cpu"))
    replay = pr.random_replay(m, T, 2)
    pr.progress(f"{size}: model built", 0.0)
    f_s = plain_pass_seconds(model, replay, 8, passes=1)
    pr.progress(f"{size}: F", f_s)
    config = hf_janus.JanusConfig(compression_rank=32, replay_batch_size=8, seed=0, cache=cache)
    rect = Rectifier(model, reference, replay, config, progress=False, factor_dtype=torch.bfloat16)
    reference.clear()
    captures = {"first": timed_capture(rect, "first", device)}
    pr.progress(f"{size}: first capture", captures["first"]["wall_s"])
    undo = [u for u in (annotate(*a) for a in ANNOTATED) if u is not None]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            captures["profiled"] = timed_capture(rect, "profiled", device)
    finally:
        for u in reversed(undo):
            u()
    pr.progress(f"{size}: profiled capture", captures["profiled"]["wall_s"])
    rect.store.drop("first")
    rect.store.drop("profiled")
    captures["reused"] = timed_capture(rect, "reused", device)
    pr.progress(f"{size}: capture reusing host blocks", captures["reused"]["wall_s"])
    rect.store.drop("reused")
    widest = max(rect.layers, key=lambda layer: layer.d_in + layer.d_out)
    out = {"size": size, "m": m, "T": T, "r": 32, "batch_size": 8, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "target_layers": len(rect.layers), "batches": -(-m // 8), "f_s": f_s, "captures": captures,
           "capture_over_f": {k: v["wall_s"] / f_s for k, v in captures.items()},
           "profile": summarize(prof, rows),
           "host_copies": {name: host_copies((8, 32, d), device) for name, d in
                           (("x", widest.d_in), ("a", widest.d_out))}}
    text = f"## {size} m={m} T={T}: profiled capture {captures['profiled']['wall_s']:.2f} s, F {f_s:.2f} s\n\n"
    text += tables(prof, rows, device)
    del rect, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, text


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="130M:32,7B:16", help="SIZE:M pairs, comma-separated (default: %(default)s)")
    ap.add_argument("--T", type=int, default=512, help="tokens per replay sample (default: %(default)s)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cache", default="memory",
                    help="JanusConfig.cache: a directory keeps factors in host memory as the 7B runs do")
    ap.add_argument("--rows", type=int, default=30, help="rows of each table (default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--text", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device is visible; --device cpu smoke-tests the path")
    command = "python -m benchmarks.perf.capture_profile " + " ".join(argv if argv is not None else sys.argv[1:])
    runs, texts = [], []
    for item in args.sizes.split(","):
        size, m = item.split(":")
        run, text = profile_size(size, int(m), args.T, device, args.cache, args.rows)
        runs.append(run)
        texts.append(text)
        pr.write_json_atomic(args.out, {"command": command, "machine": pr.machine_info(),
                                        "torch": torch.__version__, "runs": runs})
        if args.text:
            args.text.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    for run in runs:
        print(f"{run['size']} m={run['m']}: F {run['f_s']:.2f} s; captures "
              + ", ".join(f"{k} {v['wall_s']:.2f} s" for k, v in run["captures"].items())
              + f"; profile: device busy {run['profile']['device_busy_s']:.2f} s, counts {run['profile']['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
