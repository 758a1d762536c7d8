"""What one Jacobian capture asks of an accelerator, counted on the CPU (issue 65's proxies, for sessions without a
device): kernel launches, host reads (each a synchronization on a GPU), host allocations and bytes moved to the host.

A capture runs through the public ``Rectifier.capture`` with the accelerators' compression (``randomized``) and
factors kept in host memory (a cache directory, as the 7B runs keep them), under two torch modes:

* a dispatch mode counts the **kernel-launching operations** (aten operations that are not views), each attributed
  to the engine when the innermost Python frame outside torch is in ``hf_janus``, else to the model (its forward and
  the autograd backward);
* :class:`HostReads` counts the **host reads** (scalar reads, data-dependent shapes, linear algebra that checks its
  status on the host, ``.cpu()``/``tolist()``/``numpy()``), each a wait for the device on a GPU, with its call site
  (file:line) in the engine or "model".

The figures per capture: engine kernel operations per layer and batch, engine host reads per batch and their sites,
host allocations and bytes the factor store took (against the factors' own bytes: m · r · (d_in + d_out) per layer),
and whether the counts per batch stay the same at half the batch size (no Python loop over samples) and the engine's
host reads the same at twice the layers (none per layer). ``TARGETS`` holds the bounds;
``tests/engine/test_capture_counts.py`` checks them on a small shape so that a regression fails.

Usage::

    python -m benchmarks.perf.capture_counts            # 20M and 130M shapes, m=16, T=64 (a minute on 2 cores)
    python -m benchmarks.perf.capture_counts --quick    # 5M, m=8, T=16

Writes ``results/capture_counts.{json,md}`` (or ``--out``). ``--label`` names the engine in the rows: run from a
neutral directory with ``PYTHONPATH=ENGINE_DIR:REPO`` to count another revision's engine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_janus
from benchmarks.perf import measure as pr

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
_ENGINE = str(Path(hf_janus.__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent)

# Per capture. Host reads: the per-batch ones (the loss's token count and finiteness, the per-sample losses, one
# finite-check flag for all layers, the plans' host work, the Ritz steps' batched eigenproblems) and none per layer.
# Kernels: the engine launches no more than the model's own forward and backward (a capture within 2x a plain
# forward/backward's launches). Factors go to the host as they are (512-byte aligned), in the store's host blocks: a
# page-locked allocation per block, not per layer.
TARGETS = {"engine_host_reads_per_batch_max": 16, "engine_kernels_over_model_kernels_max": 1.0,
           "store_allocations_per_layer_batch_max": 0.1, "host_bytes_over_factor_bytes_max": 1.01}

# Operations that change only a tensor's metadata although their schema does not say they alias
NOT_LAUNCHING = {torch.ops.aten._unsafe_view, torch.ops.aten.is_pinned}

# aten operators whose CUDA kernels wait for the device: a scalar read (``.item()``, ``bool(t)``, ``int(t)``), data-
# dependent shapes, and linear algebra that checks its status on the host (``linalg_cholesky_ex`` and the other
# ``_ex`` variants leave the status on the device: the engine uses them to not wait)
READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_linalg_svd", "_linalg_eigh", "linalg_eigvalsh",
         "linalg_lstsq")
COPIES = ("cpu", "tolist", "numpy")  # Tensor methods that copy to the host (a no-op operator on the CPU, so patched)


# The engine's functions that run the model's own backward (on the CPU autograd runs under the caller's frame)
MODEL_PASSES = {"_backward_each_function"}


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module, relative to the package when it is the
    engine's; "model" for any other code (transformers' forward) and for the model's backward."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH) and path != __file__:
            if frame.f_code.co_name in MODEL_PASSES:
                return "model"
            if path.startswith(_ENGINE):
                return f"hf_janus{path[len(_ENGINE):]}:{frame.f_lineno}"
            return "model"
        frame = frame.f_back
    return "model"


class HostReads(TorchDispatchMode):
    """Counts the operations that would read a device value back on the host (a wait for the device on a GPU), by
    operation (:attr:`calls`) and call site (:attr:`sites`).

    A dispatch mode, because torch-function modes are switched off inside the backward pass, where the capture's hooks
    run; ``Tensor.cpu``/``tolist``/``numpy`` are no-op operators on the CPU, so they are wrapped while the mode is
    on. ``Tensor.to`` is not counted: on the CPU a copy to the host cannot be told from one to the device (which does
    not wait); the engine reads device values back with ``.cpu()``. Host-side work on the replay's attention mask is
    counted too (on the CPU it cannot be told apart).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.sites: Counter = Counter()
        self._originals: dict[str, Any] = {}

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        self.sites[_caller()] += 1

    def __enter__(self) -> "HostReads":
        for name in COPIES:
            method = self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, method))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, method in self._originals.items():
            setattr(torch.Tensor, name, method)

    def _counting(self, name: str, method: Any) -> Any:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._count(name)
            return method(tensor, *args, **kwargs)
        return counted

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = func.overloadpacket.__name__
        if name in READS or (name in ("index", "index_put", "index_put_") and _bool_index(args[1])):
            self._count(name)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class KernelOps(TorchDispatchMode):
    """Counts the aten operations that launch work (views do not), as the engine's or the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Counter = Counter()
        self.model = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not view and func.overloadpacket not in NOT_LAUNCHING:
            if _caller().startswith("hf_janus"):
                self.engine[str(func.overloadpacket)] += 1
            else:
                self.model += 1
        return func(*args, **(kwargs or {}))


@dataclass
class CaptureCounts:
    """One capture's counts (see the module's docstring)."""

    layers: int
    batches: int
    samples: int
    engine_kernels: int
    model_kernels: int
    engine_host_reads: int
    model_host_reads: int
    host_read_sites: dict
    store_allocations: Optional[int]
    host_bytes: int
    factor_bytes: int
    top_engine_kernels: list = field(default_factory=list)

    @property
    def engine_kernels_per_layer_batch(self) -> float:
        return self.engine_kernels / (self.layers * self.batches)


def count_capture(model: torch.nn.Module, reference: dict, replay: list, batch_size: int, rank: int = 8,
                  cache: Optional[str] = None) -> CaptureCounts:
    """Count one capture at the model's weights (after a warm-up capture, so that one-off set-up is not counted)."""
    rectifier_cls = pr.engine_module("rectifier").Rectifier
    with tempfile.TemporaryDirectory() as tmp:
        config = hf_janus.JanusConfig(compression_rank=rank, replay_batch_size=batch_size, compression="randomized",
                                      cache=cache or tmp)
        rect = rectifier_cls(model, reference, replay, config, progress=False)
        rect.capture("warm-up")
        rect.store.drop("warm-up")
        # the store as an accelerator's holds its factors: in host blocks (on the CPU they are not copied by default)
        rect.store.host_blocks = True
        allocations = getattr(rect.store, "host_allocations", None)  # None: an engine that does not count them
        reads, kernels = HostReads(), KernelOps()
        with kernels, reads:
            rect.capture("counted")
        factor_bytes = 0
        for layer in rect.layers:
            x, a = rect.store.get("counted", layer.name)
            factor_bytes += x.nbytes + a.nbytes
        host_bytes = rect.store.held_bytes
        engine_reads = sum(n for site, n in reads.sites.items() if site != "model")
        return CaptureCounts(
            layers=len(rect.layers), batches=len(rect.local_batches), samples=len(replay),
            engine_kernels=sum(kernels.engine.values()), model_kernels=kernels.model,
            engine_host_reads=engine_reads, model_host_reads=reads.sites.get("model", 0),
            host_read_sites=dict(reads.sites), store_allocations=(None if allocations is None
                               else rect.store.host_allocations - allocations), host_bytes=host_bytes,
            factor_bytes=factor_bytes, top_engine_kernels=kernels.engine.most_common(12))


def scenario(size: str, m: int, T: int, batch_size: int, rank: int, seed: int = 0) -> CaptureCounts:
    """One capture of a LLaMA shape of ``measure.SIZES`` fine-tuned synthetically (float32, on the CPU)."""
    model = pr.build_llama(size, seed, torch.device("cpu"), torch.float32)
    reference = pr.fake_finetune(model, 0.05, seed + 1, torch.device("cpu"))
    return count_capture(model, reference, pr.random_replay(m, T, seed + 2), batch_size, rank=rank)


def check(counts: CaptureCounts, half_batch: CaptureCounts) -> dict[str, bool]:
    """Each target against one capture and the same replay at half the batch size."""
    per_batch = counts.engine_kernels / counts.batches
    per_batch_half = half_batch.engine_kernels / half_batch.batches
    layer_batches = counts.layers * counts.batches
    return {
        "engine_host_reads_per_batch": counts.engine_host_reads / counts.batches
        <= TARGETS["engine_host_reads_per_batch_max"],
        "engine_kernels_over_model_kernels": counts.engine_kernels
        <= TARGETS["engine_kernels_over_model_kernels_max"] * counts.model_kernels,
        "store_allocations_per_layer_batch": counts.store_allocations is not None
        and counts.store_allocations <= TARGETS["store_allocations_per_layer_batch_max"] * layer_batches,
        "host_bytes_over_factor_bytes": counts.host_bytes <= TARGETS["host_bytes_over_factor_bytes_max"]
        * counts.factor_bytes,
        # no Python loop over samples: a batch of half the samples launches as many kernels (within 2%: the batched
        # Ritz steps group differently) and reads as often
        "no_loop_over_samples": abs(per_batch - per_batch_half) <= 0.02 * per_batch
        and counts.engine_host_reads / counts.batches == half_batch.engine_host_reads / half_batch.batches,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["config", "layers × batches", "engine kernels / layer·batch", "model kernels / layer·batch",
            "engine host reads / batch", "host reads by the model / batch", "store allocations / layer·batch",
            "host bytes ÷ factor bytes", "half batch: same per-batch counts", "targets met"]
    out = [md_row(head), "|" + "---|" * len(head)]
    for row in rows:
        c = row["counts"]
        met = row["met"]
        out.append(md_row([
            row["config"], f"{c['layers']} × {c['batches']}",
            f"{c['engine_kernels'] / (c['layers'] * c['batches']):.1f}",
            f"{c['model_kernels'] / (c['layers'] * c['batches']):.1f}",
            f"{c['engine_host_reads'] / c['batches']:.1f}", f"{c['model_host_reads'] / c['batches']:.1f}",
            "-" if c["store_allocations"] is None else f"{c['store_allocations'] / (c['layers'] * c['batches']):.2f}",
            f"{c['host_bytes'] / c['factor_bytes']:.3f}", str(met["no_loop_over_samples"]),
            "all" if all(met.values()) else ", ".join(k for k, v in met.items() if not v) + " missed"]))
    return "\n".join(out)


def md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 5M shape, m=8, T=16 (a smoke test)")
    ap.add_argument("--sizes", default="20M,130M")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="current", help="the engine's name in the rows (default: %(default)s)")
    ap.add_argument("--append", action="store_true", help="add the rows to --out's instead of replacing them")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    # r below T, so that every sample is compressed (at T <= r the factors are the rows themselves)
    sizes, m, T, rank = (["5M"], 8, 16, 8) if args.quick else (args.sizes.split(","), args.m, args.T, 32)
    command = "python -m benchmarks.perf.capture_counts " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    rows = []
    for size in sizes:
        counts, half = scenario(size, m, T, 8, rank), scenario(size, m, T, 4, rank)
        rows.append({"config": f"{size} m={m} T={T} r={rank} batch 8, {args.label}", "counts": asdict(counts),
                     "half_batch_counts": asdict(half), "met": check(counts, half), "command": command})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    out = args.out or RESULTS / ("capture_counts_quick.json" if args.quick else "capture_counts.json")
    if args.append and out.exists():
        rows = json.loads(out.read_text(encoding="utf-8"))["runs"] + rows
    pr.write_json_atomic(out, {"machine": pr.machine_info(), "targets": TARGETS, "runs": rows})
    out.with_suffix(".md").write_text(table(rows) + "\n", encoding="utf-8")
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
