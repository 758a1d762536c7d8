"""Where the time of a JANUS rectification goes (issue 7), on CPU, and the LLaMA-2-7B-shaped run on a GPU.

CPU sweep (default). Random-init LLaMA-shaped causal LMs (vocab 32000, untied head) with a fake fine-tune
(``W += scale·std(W)·N(0, 1)`` on every target weight) and a random-token replay; one configuration per
fresh subprocess, so that each peak RSS is its own. Swept: model size (at m=32, T=64), m (at the middle
size) and T (at the middle size), r=32, plus the middle configuration with ``cache=<directory>`` so the
disk I/O shows. Every run takes the same forced schedule of Jacobian evaluations (``--evals``, default 4:
the base capture, a rejected and a forced-accepted trial at step 0, the final unchecked step 1), so runs
compare like for like and every part of Algorithm 1 (rejection, acceptance, a second step) is exercised.

Per run it records ``report.timings`` (the engine's phases: forward_backward, compression, ghost, io) and a
finer split measured by wrapping engine functions (exclusive time per operation, grouped by the
Rectifier step it ran in: capture, projection, orientation comparison, per-layer statistics), the peak RSS
(psutil sampling thread and the kernel high-water mark), and the number of Jacobian evaluations. ``Instrument``
takes a callback run after each Rectifier step; ``PartialJSON`` uses it (in ``scale.py`` and ``qlora.py``) to
rewrite the figures so far atomically, so that a run killed at a device call's time limit still leaves them.

``--baseline REV`` additionally runs every configuration with the engine of git revision REV (extracted with
``git archive`` into a temporary directory that goes first on PYTHONPATH), alternating baseline and current
runs, and reports current/baseline ratios from the same invocation.

``--gpu-7b`` runs one LLaMA-2-7B-shaped model (random init, bf16 base weights) on the GPU: m=256, T=512,
r=32, the same forced schedule, compressed factors stored in bf16 (the paper caches float16) and kept in
host memory (pinned) up to a budget, spilling to ``--cache`` beyond it. Results go to
``benchmarks/perf/results/gpu_7b.json``; see ``benchmarks/perf/RESULTS.md``.

Usage::

    python benchmarks/perf/profile_rectify.py                      # CPU sweep, ~15 min on an idle 2-core box
    python benchmarks/perf/profile_rectify.py --quick              # smoke test, ~1 min
    python benchmarks/perf/profile_rectify.py --baseline da202fb   # before/after, same invocation
    python benchmarks/perf/profile_rectify.py --gpu-7b             # one H200 (or any >= 80 GB GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
import torch
from torch import Tensor

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))  # bench_ghost's measurement helpers (PeakRSS, OtherCpu, machine_info)

from bench_ghost import OtherCpu, PeakRSS, machine_info, md_table, run_figures  # noqa: E402

MiB = 1 << 20
VOCAB = 32000  # LLaMA-2

# LLaMA-shaped sizes: (hidden, layers, heads, intermediate). Parameter counts include the 32000-token
# embedding and untied LM head (2 x 32000 x hidden), which dominate the small ones.
SIZES = {
    "20M": (256, 4, 4, 688),
    "60M": (512, 8, 8, 1376),
    "130M": (768, 12, 12, 2048),
    # --quick
    "5M": (64, 2, 2, 172),
    "9M": (128, 2, 4, 344),
}
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=VOCAB, max_position_embeddings=4096)


def sweep(quick: bool) -> list[dict[str, Any]]:
    """The CPU configurations: model size, then m and T around the middle size, then the disk cache."""
    if quick:
        small, mid, sizes, ms, ts, m0, t0 = "5M", "9M", ["5M", "9M"], [8], [8], 16, 16
    else:
        small, mid, sizes, ms, ts, m0, t0 = "20M", "60M", ["20M", "60M", "130M"], [16, 64], [32, 128], 32, 64
    runs = [dict(group="size", size=s, m=m0, T=t0, cache="memory") for s in sizes]
    runs += [dict(group="m", size=mid, m=m, T=t0, cache="memory") for m in ms]
    runs += [dict(group="T", size=mid, m=m0, T=t, cache="memory") for t in ts]
    runs += [dict(group="cache", size=mid, m=m0, T=t0, cache="disk")]
    del small
    return runs


def schedule(evals: int) -> dict[str, Any]:
    """JanusConfig fields that make Algorithm 1 take exactly ``evals`` Jacobian evaluations (even, >= 2).

    τ=1 rejects every checked trial whose mean cosine is below 1 (always, once the weights move); with
    β=0.7 and min_alpha=0.5 the second trial of a step (α=0.7) would shrink below min_alpha, so it is taken
    ("forced"). Each of the first k-1 steps thus costs two evaluations, the last (unchecked, α=1) step one,
    plus the base capture: 2k in all.
    """
    if evals < 2 or evals % 2:
        raise SystemExit(f"--evals must be even and >= 2, got {evals}")
    if evals == 2:
        return dict(tau=0.0, max_steps=1)
    return dict(tau=1.0, beta=0.7, min_alpha=0.5, max_steps=evals // 2)


# ------------------------------------------------------------------------------------------------------
# Instrumentation: exclusive wall time per engine operation, grouped by the Rectifier step it ran in
# ------------------------------------------------------------------------------------------------------

# Modules by their engine name: hf_janus.engine.<name> (hf_janus.<name> in engines before the package layout).
SECTIONS = [  # (module, qualified attribute, label): the Rectifier's steps; the private names are the engines' before
    # the rectifier was split (issue 32), kept so that a baseline commit still profiles
    ("rectifier", "replay_losses", "finetuned_loss"),
    ("rectifier", "Rectifier.capture", "capture"),
    ("step_loop", "StepLoop.project_all", "project"),
    ("step_loop", "StepLoop.compare_all", "compare"),
    ("rectifier", "layer_statistics", "stats"),
    ("rectifier", "Rectifier._capture", "capture"),
    ("rectifier", "Rectifier._project_all", "project"),
    ("rectifier", "Rectifier._compare_all", "compare"),
    ("rectifier", "Rectifier._layer_stats", "stats"),
]
OPS = [  # leaf operations; a missing attribute (older/newer engine) is skipped
    ("capture", "compress_sequence", "compress"),
    ("capture", "sequence_basis", "compress"),
    ("ghost", "per_sample_gradients", "materialize"),
    ("ghost", "LayerJacobian.gram", "gram"),
    ("ghost", "LayerJacobian.cross_gram", "cross_gram"),
    ("ghost", "LayerJacobian.jvp", "jvp"),
    ("ghost", "LayerJacobian.vjp", "vjp"),
    ("step_loop", "eig_psd", "eig"),
    ("step_loop", "principal_cosines", "cosines"),
    ("rectifier", "eig_psd", "eig"),
    ("rectifier", "principal_cosines", "cosines"),
    ("store", "FactorStore.get", "store_get"),
    ("store", "FactorStore.append", "store_put"),
]


def engine_module(name: str) -> Any:
    """``hf_janus.engine.<name>``, or ``hf_janus.<name>`` for a baseline engine from before the package layout."""
    try:
        return importlib.import_module(f"hf_janus.engine.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"hf_janus.{name}")


def progress(what: str, seconds: float) -> None:
    """A timestamped line on stderr: long runs (the 7B one) show where they are, and a killed one how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {seconds:.1f} s", file=sys.stderr, flush=True)


class Instrument:
    """Wraps engine functions to accumulate exclusive seconds per (section, op) and call counts.

    Exclusive: a wrapped op called inside another wrapped op is subtracted from the outer one, so the
    figures add up. Accelerator work is synchronized at every boundary (as the engine's own timer does).
    """

    def __init__(self, device: torch.device, verbose: bool = False, ops: bool = True,
                 on_section: Optional[Callable[["Instrument", str, Any], None]] = None):
        # ops=False: the Rectifier steps only (one synchronization per step, not per operation).
        # on_section(instrument, label, owner) runs after each step ends; owner: the object the step ran on (the
        # Rectifier, its StepLoop), so that a caller can read live state (PartialJSON) without timing anything twice
        self.device, self.verbose, self.ops, self.on_section = device, verbose, ops, on_section
        self.section_calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.section_seconds: dict[str, float] = defaultdict(float)
        self.section_cpu: dict[str, float] = defaultdict(float)
        self._section = "outside"
        self._stack: list[list[float]] = []  # per active op: [child wall seconds, child CPU seconds]
        self._undo: list[Callable[[], None]] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wrap(self, module_name: str, attr: str, make: Callable[[Callable, str], Callable], label: str) -> None:
        try:
            module = engine_module(module_name)
        except ModuleNotFoundError:  # a module of another engine version
            return
        owner, name = module, attr
        if "." in attr:
            cls_name, name = attr.split(".")
            owner = getattr(module, cls_name, None)
        original = getattr(owner, name, None) if owner is not None else None
        if original is None:
            return
        wrapped = make(original, label)
        if isinstance(owner.__dict__.get(name), (staticmethod, classmethod)):
            return
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, original))

    def _section_wrapper(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            outer, self._section = self._section, label
            self._sync()
            start, cpu0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                elapsed = time.perf_counter() - start
                self.section_seconds[label] += elapsed
                self.section_cpu[label] += time.process_time() - cpu0
                self.section_calls[label] += 1
                self._section = outer
                if self.verbose:
                    progress(label, elapsed)
                if self.on_section is not None:
                    self.on_section(self, label, args[0] if args else None)
        return inner

    def _op_wrapper(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            start, cpu0 = time.perf_counter(), time.process_time()
            self._stack.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
                child, child_cpu = self._stack.pop()
                if self._stack:
                    self._stack[-1][0] += elapsed
                    self._stack[-1][1] += cpu
                self.seconds[self._section][label] += elapsed - child
                self.cpu[self._section][label] += cpu - child_cpu
                self.calls[self._section][label] += 1
        return inner

    @property
    def current_section(self) -> str:
        """The Rectifier step running now ("outside" between steps)."""
        return self._section

    def __enter__(self) -> "Instrument":
        for module, attr, label in SECTIONS:
            self._wrap(module, attr, self._section_wrapper, label)
        for module, attr, label in OPS if self.ops else ():
            self._wrap(module, attr, self._op_wrapper, label)
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()

    def as_dict(self) -> dict[str, Any]:
        out = {}
        for section, total in self.section_seconds.items():
            ops = dict(self.seconds.get(section, {}))
            out[section] = {"seconds": total, "ops": ops, "calls": dict(self.calls.get(section, {})),
                            "unattributed": total - sum(ops.values()),
                            "cpu_seconds": self.section_cpu[section], "ops_cpu": dict(self.cpu.get(section, {}))}
        return out


# ------------------------------------------------------------------------------------------------------
# Figures so far: a run killed at a device call's time limit still leaves them
# ------------------------------------------------------------------------------------------------------

GIB = float(1 << 30)


def write_json_atomic(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path`` through a temporary file and ``os.replace``: a reader, or a kill mid-write,
    never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def plan_figures(plan: Any) -> dict[str, Any]:
    """The memory plan's predictions and placements in GiB (a ``MemoryPlan`` or its ``to_dict()``; {} for none)."""
    plan = plan.to_dict() if hasattr(plan, "to_dict") else (plan or {})
    if not plan:
        return {}
    gib = lambda key: plan[key] / GIB if plan.get(key) is not None else None  # noqa: E731
    return {"predicted_peak_device_gib": gib("peak_device_bytes"), "predicted_peak_host_gib": gib("peak_host_bytes"),
            "predicted_disk_gib": gib("disk_bytes"), "factor_host_budget_gib": gib("factor_host_budget"),
            "placements": plan.get("placements"), "captures": plan.get("captures"),
            "captures_alive": plan.get("captures_alive"), "factor_dtype": plan.get("factor_dtype"),
            "plan_fits": plan.get("fits")}


def peak_host_bytes() -> int:
    """The kernel's high-water mark of this process's resident memory (model build included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_host_gib() -> float:
    return peak_host_bytes() / GIB


class PartialJSON:
    """What a run has measured so far, rewritten atomically at the stages the caller marks and after every Rectifier
    step (pass :meth:`on_section` to :class:`Instrument`): elapsed and per-step seconds, evaluations, peak GPU and
    host memory, and once known the memory plan. ``path=None`` writes nothing."""

    def __init__(self, path: Optional[str], device: torch.device, verbose: bool = False, **fields: Any):
        self.path, self.device, self.fields = (Path(path) if path else None), torch.device(device), dict(fields)
        self.verbose = verbose  # a timestamped line per stage on stderr (Instrument(verbose=True) does the steps)
        self.start = time.perf_counter()
        # the process's age too: a phase's time limit also counts the interpreter's start and the imports
        self.process_start = psutil.Process().create_time()
        self.instrument: Optional[Instrument] = None
        self.rectifier: Any = None  # learnt from the steps when the caller cannot reach it (rectify_live_peft)
        self.report: Any = None  # the live report, from the StepLoop's steps

    def stage(self, name: str, **fields: Any) -> None:
        """Record that the run reached ``name`` (with ``fields``, e.g. F once measured) and rewrite the file."""
        if self.verbose:
            progress(name, time.perf_counter() - self.start)
        self._update(name, **fields)

    def _update(self, name: str, **fields: Any) -> None:
        self.fields.update(fields)
        self.fields["stage"] = name
        self.write()

    def on_section(self, inst: Instrument, label: str, owner: Any) -> None:
        self.instrument = inst
        if hasattr(owner, "memory_plan") and hasattr(owner, "store"):
            self.rectifier = owner
        if hasattr(getattr(owner, "report", None), "num_jacobian_evals"):
            self.report = owner.report
        self._update(f"after {label}")

    def evaluations(self) -> int:
        """The report's count once a StepLoop step has run; before that, the captures taken (θ0's)."""
        if self.report is not None:
            return self.report.num_jacobian_evals
        return self.instrument.section_calls.get("capture", 0) if self.instrument else 0

    def snapshot(self) -> dict[str, Any]:
        out = {**self.fields, "elapsed_s": time.perf_counter() - self.start,
               "process_s": time.time() - self.process_start, "peak_host_gib": peak_host_gib(),
               "evaluations": self.evaluations()}
        if self.device.type == "cuda" and torch.cuda.is_initialized():  # a parent process must not make a context
            out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
        if self.instrument is not None:
            out["sections_s"] = dict(self.instrument.section_seconds)
            out["section_calls"] = dict(self.instrument.section_calls)
            out["current_section"] = self.instrument.current_section
        if self.report is not None:
            out["recaptures"] = getattr(self.report, "recaptures", None)
        if self.rectifier is not None:  # getattr: a baseline engine may have no plan or store
            out.update(plan_figures(getattr(self.rectifier, "memory_plan", None)))
            out["peak_captures"] = getattr(getattr(self.rectifier, "store", None), "peak_captures", None)
        sections, f_s = out.get("sections_s", {}), out.get("f_s")
        if f_s and out["evaluations"]:  # R_eval of the evaluations so far (scale.py's definition)
            per_eval = sum(sections.get(k, 0.0) for k in ("capture", "project", "compare"))
            out["r_eval_so_far"] = per_eval / (out["evaluations"] * f_s)
        return out

    def write(self) -> None:
        if self.path is None:
            return
        try:
            write_json_atomic(self.path, self.snapshot())
        except OSError as err:  # a full disk must not end the run being measured
            print(f"partial JSON not written: {err}", file=sys.stderr, flush=True)

    def stop_on_sigterm(self) -> None:
        """On SIGTERM (``timeout`` at the phase's limit) record where the run was, then exit at once (124, as
        ``timeout`` does): no clean-up that could outlast the kill grace."""
        def handler(signum: int, frame: Any) -> None:
            self.stage("killed by SIGTERM (the phase's time limit)")
            os._exit(124)
        signal.signal(signal.SIGTERM, handler)


# ------------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------------


def build_llama(size: str, seed: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if size == "7B":
        config = LlamaConfig(**LLAMA2_7B)
    else:
        hidden, layers, heads, inter = SIZES[size]
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads, vocab_size=VOCAB,
                             max_position_embeddings=1024)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in the target dtype: a 7B model in fp32 is 27 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.no_grad()
def fake_finetune(model: torch.nn.Module, scale: float, seed: int, reference_device: torch.device) -> dict[str, Tensor]:
    """θ0 = the target weights as built (on ``reference_device``); then ``W += scale·std(W)·N(0, 1)`` in place."""
    import hf_janus

    targets = hf_janus.resolve_target_modules(model)
    reference = {}
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, module in targets.items():
        w = module.weight
        reference[name + ".weight"] = w.detach().to(reference_device, copy=True)
        noise = torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32)
        w.add_((scale * w.float().std() * noise).to(w.dtype))
    return reference


def random_replay(m: int, T: int, seed: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (T,), generator=gen).tolist()} for _ in range(m)]


def factor_bytes(targets: dict[str, torch.nn.Module], m: int, r: int, itemsize: int) -> int:
    """Bytes of one capture's compressed factors: m x r x (d_in + d_out) per layer."""
    return sum(m * r * (mod.weight.shape[0] + mod.weight.shape[1]) * itemsize for mod in targets.values())


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One rectification with instrumentation; meant to run in its own process (see ``launch``)."""
    import hf_janus

    Rectifier = engine_module("rectifier").Rectifier

    device = torch.device(spec.get("device", "cpu"))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    say = (lambda what: progress(what, time.perf_counter() - t0)) if spec.get("verbose") else (lambda what: None)
    model = build_llama(spec["size"], spec["seed"], device, dtype)
    say("model built")
    n_params = sum(p.numel() for p in model.parameters())
    targets = hf_janus.resolve_target_modules(model)
    reference = fake_finetune(model, spec["delta_scale"], spec["seed"] + 1,
                              torch.device(spec.get("reference_device", device.type)))
    say("fake fine-tune done")
    replay = random_replay(spec["m"], spec["T"], spec["seed"] + 2)
    cache_dir = None
    if spec["cache"] != "memory":
        cache_dir = tempfile.mkdtemp(prefix="janus-profile-", dir=spec.get("cache_root") or None)
    cfg = dict(rank=spec["r"], replay_batch_size=spec["batch_size"], seed=spec["seed"],
               compression=spec.get("compression", "auto"),
               cache=cache_dir or "memory", **schedule(spec["evals"]))
    config = hf_janus.JanusConfig(**cfg)
    store_options = spec.get("store_options") or {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with PeakRSS(interval_s=0.005) as mon, OtherCpu() as cpu:
            start = time.perf_counter()
            rect = Rectifier(model, reference, replay, config, progress=False, **store_options)
            setup = time.perf_counter() - start
            say("Rectifier set up")
            if spec.get("free_reference"):
                reference.clear()  # the Rectifier holds its own copy; free the caller's (7B: 13 GB)
            with Instrument(device, verbose=spec.get("verbose", False)) as inst:
                report = rect.run().report
            wall = time.perf_counter() - start
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    timings = dict(report.timings)
    phases = ("forward_backward", "compression", "ghost", "io", "communication")
    timings["other"] = timings.get("total", 0.0) - sum(timings.get(k, 0.0) for k in phases)
    timings["setup"] = setup
    out = {
        **spec,
        "engine": os.path.dirname(hf_janus.__file__),
        "params": n_params,
        "target_layers": len(targets),
        "target_params": sum(mod.weight.numel() for mod in targets.values()),
        "factor_bytes_per_capture_float32": factor_bytes(targets, spec["m"], spec["r"], 4),
        "config": config.to_dict(),
        **run_figures(report, wall, cpu, mon),
        "timings": timings,
        "breakdown": inst.as_dict(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the smallest wall time, carrying every run's wall time and contention figure."""
    best = dict(min(runs, key=lambda r: r["wall_seconds"]))
    best["all_wall_seconds"] = [r["wall_seconds"] for r in runs]
    best["all_other_processes_cores"] = [r["other_processes_cores"] for r in runs]
    return best


def launch(spec: dict[str, Any], engine_dir: Optional[str] = None, script: Optional[str] = None) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; ``engine_dir`` (holding an ``hf_janus`` package) goes first on the path.

    ``script`` (default: this file) is run as ``script --_run SPEC --_result RESULT`` and must write the result JSON.
    """
    env = dict(os.environ)
    if engine_dir:
        env["PYTHONPATH"] = engine_dir + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        Path(spec_path).write_text(json.dumps(spec), encoding="utf-8")
        # Run from a neutral directory so the repository checkout does not shadow engine_dir.
        subprocess.run([sys.executable, str(Path(script or __file__).resolve()), "--_run", spec_path,
                        "--_result", result_path], check=True, env=env, cwd=tmp)
        return json.loads(Path(result_path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def engine_at(rev: str) -> Iterator[str]:
    """A temporary directory holding ``hf_janus`` as of git revision ``rev``."""
    tmp = tempfile.mkdtemp(prefix="janus-baseline-")
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "hf_janus"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------------

OP_ORDER = ["compress", "gram", "cross_gram", "eig", "cosines", "jvp", "vjp", "materialize", "store_get",
            "store_put"]


def op_totals(row: dict[str, Any]) -> dict[str, float]:
    """Seconds per op summed over sections."""
    totals: dict[str, float] = defaultdict(float)
    for section in row["breakdown"].values():
        for op, sec in section["ops"].items():
            totals[op] += sec
    return totals


def cpu_phases(row: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (this process, all threads) per engine phase, from the instrumented split.

    On a shared machine wall time depends on how many time slices the process got; CPU time measures
    the work, so before/after comparisons use it (with ``--threads 1`` there is no spinning to inflate it).
    """
    b = row["breakdown"]
    sec = lambda name: b.get(name, {}).get("cpu_seconds", 0.0)  # noqa: E731
    ops = lambda name: b.get(name, {}).get("ops_cpu", {})  # noqa: E731
    store = sum(v for s in b.values() for k, v in s.get("ops_cpu", {}).items() if k.startswith("store"))
    compress = sum(s.get("ops_cpu", {}).get("compress", 0.0) for s in b.values())
    capture_other = sum(v for k, v in ops("capture").items() if k != "compress")
    ghost = sum(sec(n) for n in ("project", "compare", "stats")) - sum(
        v for n in ("project", "compare", "stats") for k, v in ops(n).items() if k.startswith("store"))
    return {"forward_backward": sec("finetuned_loss") + sec("capture") - compress - capture_other,
            "compression": compress, "ghost": ghost, "store": store, "total": row["cpu_seconds"]}


def config_label(row: dict[str, Any]) -> str:
    return f"{row['size']} m={row['m']} T={row['T']}" + (" disk" if row["cache"] != "memory" else "")


def main_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        t = row["timings"]
        total = t.get("total", 0.0) or 1.0
        pct = lambda k: f"{t.get(k, 0.0):.2f} ({100 * t.get(k, 0.0) / total:.0f}%)"  # noqa: E731
        out.append([config_label(row), f"{row['params'] / 1e6:.0f}M", f"{row['wall_seconds']:.1f}",
                    str(row["num_jacobian_evals"]), f"{t.get('total', 0) / row['num_jacobian_evals']:.2f}",
                    pct("forward_backward"), pct("compression"), pct("ghost"), pct("io"), f"{t['other']:.2f}",
                    mib(row["rss_peak_bytes"]), mib(row["rss_peak_delta_bytes"]),
                    mib(row["factor_bytes_per_capture_float32"]),
                    ", ".join(f"{v} {k}" for k, v in row["layer_paths"].items()), f"{row['other_processes_cores']:.2f}"])
    return md_table(["config", "params", "wall s", "Jacobian evals", "s / eval", "fwd+bwd s", "compression s",
                     "ghost s", "io s", "other s", "peak RSS MiB", "RSS increase MiB", "factors / capture MiB",
                     "paths", "cores busy with other processes"], out)


def ghost_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        ops = op_totals(row)
        b = row["breakdown"]
        out.append([config_label(row)] + [f"{ops.get(k, 0.0):.2f}" for k in OP_ORDER]
                   + [f"{b.get(s, {}).get('seconds', 0.0):.2f}" for s in ("finetuned_loss", "capture", "project",
                                                                          "compare", "stats")])
    return md_table(["config"] + [f"{k} s" for k in OP_ORDER]
                    + ["step: finetuned loss s", "step: captures s", "step: projections s", "step: comparisons s",
                       "step: statistics s"], out)


def comparison_table(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    out = []
    for base, cur in pairs:
        cb, cc = cpu_phases(base), cpu_phases(cur)

        def ratio(k: str) -> str:
            text = f"{cb.get(k, 0.0):.2f} → {cc.get(k, 0.0):.2f}"
            return text + (f" ({cb[k] / cc[k]:.2f}x)" if cc.get(k, 0.0) > 0.005 and cb.get(k, 0.0) > 0.005 else "")

        out.append([config_label(cur), ratio("total"), ratio("forward_backward"), ratio("compression"), ratio("ghost"),
                    ratio("store"),
                    f"{base['wall_seconds']:.1f} → {cur['wall_seconds']:.1f} "
                    f"({base['wall_seconds'] / cur['wall_seconds']:.2f}x)",
                    f"{mib(base['rss_peak_bytes'])} → {mib(cur['rss_peak_bytes'])}",
                    f"{base['num_jacobian_evals']} / {cur['num_jacobian_evals']}",
                    _max_diff_residual(base, cur),
                    f"{max(base['all_other_processes_cores']):.2f} / {max(cur['all_other_processes_cores']):.2f}"])
    return md_table(["config", "CPU s, whole run (speed-up)", "fwd+bwd CPU s", "compression CPU s", "ghost CPU s",
                     "factor store CPU s", "wall s", "peak RSS MiB", "Jacobian evals",
                     "max residual before / after", "max cores busy with other processes"], out)


def _max_diff_residual(base: dict[str, Any], cur: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    return f"{fmt(base['max_residual'])} / {fmt(cur['max_residual'])}"


def mib(n: float) -> str:
    return f"{n / MiB:.0f}"


# ------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, smoke test (~1 minute)")
    ap.add_argument("--gpu-7b", action="store_true", help="the LLaMA-2-7B-shaped run on one CUDA GPU")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also run every CPU configuration with hf_janus from git revision REV (before/after)")
    ap.add_argument("--only", default=None,
                    help="comma-separated indices into the sweep (0-based) to run a subset, e.g. 0,3")
    ap.add_argument("--evals", type=int, default=4, help="Jacobian evaluations per run, even (default: %(default)s)")
    ap.add_argument("--r", type=int, default=32, help="compression rank (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=None, help="replay batch size (default: 8; --gpu-7b: 8)")
    ap.add_argument("--delta-scale", type=float, default=0.05, help="fake fine-tune scale (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per configuration (and per engine with --baseline, alternating); the fastest is "
                         "reported, all wall times are kept in the JSON (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each run; 0 = torch default")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: results/profile_cpu[_quick].json "
                    "or results/gpu_7b.json); the tables go next to it as .md")
    # --gpu-7b knobs
    ap.add_argument("--m", type=int, default=256, help="--gpu-7b: replay samples (default: %(default)s)")
    ap.add_argument("--T", type=int, default=512, help="--gpu-7b: replay length (default: %(default)s)")
    ap.add_argument("--factor-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="--gpu-7b: storage dtype of the compressed factors (default: %(default)s)")
    ap.add_argument("--host-budget-gib", type=float, default=90.0,
                    help="--gpu-7b: host memory the factor store may hold before spilling to --cache, counting pinned "
                         "pieces at their power-of-two allocated size (a 41 GB bf16 capture pins 46 GiB): 90 GiB on a "
                         "128 GiB host holds one capture and most of a second; the rest, and a third capture alive at "
                         "once (θ0's, the current and the trial point's), go to disk (default: %(default)s)")
    ap.add_argument("--cache", default=None, help="--gpu-7b: spill directory (default: a temporary directory)")
    ap.add_argument("--compression", default="auto", choices=["auto", "exact", "randomized"],
                    help="--gpu-7b: JanusConfig.compression (default: %(default)s, i.e. randomized on a GPU)")
    ap.add_argument("--size", default="7B", choices=["7B", *SIZES],
                    help="--gpu-7b: model shape; a small one with --device cpu smoke-tests the path (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="--gpu-7b: device (default: %(default)s)")
    ap.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 8
    return args


def run_cpu(args: argparse.Namespace) -> None:
    specs = sweep(args.quick)
    if args.only:
        specs = [specs[int(i)] for i in args.only.split(",")]
    for spec in specs:
        spec.update(r=args.r, evals=args.evals, batch_size=args.batch_size, delta_scale=args.delta_scale,
                    seed=args.seed, device="cpu", dtype="float32", threads=args.threads)
    out_path = args.out or RESULTS / ("profile_cpu_quick.json" if args.quick else "profile_cpu.json")
    rows, pairs = [], []
    with contextlib.ExitStack() as stack:
        base_dir = stack.enter_context(engine_at(args.baseline)) if args.baseline else None
        with OtherCpu() as overall:
            for i, spec in enumerate(specs):
                runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
                for rep in range(args.repeats):
                    for which, engine in (("baseline", base_dir), ("current", None)):
                        if which == "baseline" and not base_dir:
                            continue
                        start = time.perf_counter()
                        runs[which].append(launch(spec, engine))
                        print(f"[{i}.{rep}] {which:8s} {config_label(runs[which][-1])}: "
                              f"{runs[which][-1]['wall_seconds']:.1f}s ({time.perf_counter() - start:.0f}s with "
                              f"process start)", file=sys.stderr, flush=True)
                best = {k: fastest(v) for k, v in runs.items() if v}
                rows.append(best["current"])
                if base_dir:
                    pairs.append((best["baseline"], best["current"]))
    result = {"machine": machine_info(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items() if not k.startswith("_")},
              "schedule": schedule(args.evals), "rows": rows,
              "baseline_rows": [b for b, _ in pairs], "baseline_rev": args.baseline,
              "total_seconds": overall.wall, "other_processes_mean_cores": overall.other_cores}
    md = ["### Where the time goes (CPU, current engine)\n", main_table(rows), "",
          "### Split by operation (exclusive seconds, summed over the run) and by Rectifier step\n",
          ghost_table(rows), ""]
    if pairs:
        md += [f"### Before ({args.baseline}) → after (working tree), same invocation, alternating runs\n",
               comparison_table(pairs), ""]
    md.append(f"Machine: {result['machine']['cpu_model']}, {result['machine']['cpu_count_logical']} CPUs, torch "
              f"{result['machine']['torch']}; {args.evals} Jacobian evaluations per run ({schedule(args.evals)}), "
              f"r={args.r}, replay batch {args.batch_size}; other processes kept "
              f"{overall.other_cores:.2f} cores busy on average over the {overall.wall:.0f} s invocation.\n")
    text = "\n".join(md)
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out_path.with_suffix(".md").write_text(text, encoding="utf-8")
    print(f"wrote {out_path} and {out_path.with_suffix('.md')}", file=sys.stderr)


def run_gpu_7b(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--gpu-7b needs a CUDA device; none is visible")
    FactorStore = engine_module("store").FactorStore
    cache_root = args.cache or tempfile.gettempdir()
    spec = dict(group="gpu-7b", size=args.size, m=args.m, T=args.T, r=args.r, evals=args.evals,
                batch_size=args.batch_size, delta_scale=args.delta_scale, seed=args.seed, device=args.device,
                compression=args.compression,
                dtype="bfloat16", reference_device="cpu", free_reference=True, verbose=True,
                # Compressed factors: m x r x Σ(d_in + d_out) = 41 GB per capture in bf16 (82 GB in fp32),
                # and up to three captures live at once (θ0's for the statistics, the current and the trial
                # point's): they cannot stay on the GPU next to the model and the rectifier's float32 state,
                # so they go to pinned host memory up to a budget and to disk beyond it.
                cache="disk", cache_root=cache_root,
                store_options={"factor_dtype": args.factor_dtype,
                               "memory_budget_bytes": int(args.host_budget_gib * (1 << 30))})
    if "memory_budget_bytes" not in FactorStore.__init__.__code__.co_varnames:
        raise SystemExit("this hf_janus has no host-memory tier in FactorStore; the 7B run needs it")
    start = time.perf_counter()
    row = launch(spec)
    row["end_to_end_seconds_incl_model_build"] = time.perf_counter() - start
    t = row["timings"]
    lines = [
        f"### LLaMA-2-{args.size}-shaped, random init, bf16, m={args.m}, T={args.T}, r={args.r}, "
        f"compression {args.compression}, "
        f"{row.get('gpu', args.device)}\n",
        md_table(["wall s (rectify incl. setup)", "Jacobian evals", "fwd+bwd s", "compression s", "ghost s", "io s",
                  "other s", "setup s", "GPU max allocated GiB", "host peak RSS GiB"],
                 [[f"{row['wall_seconds']:.1f}", str(row["num_jacobian_evals"]), f"{t.get('forward_backward', 0):.1f}",
                   f"{t.get('compression', 0):.1f}", f"{t.get('ghost', 0):.1f}", f"{t.get('io', 0):.1f}",
                   f"{t['other']:.1f}", f"{t['setup']:.1f}", f"{row.get('cuda_max_allocated_bytes', 0) / (1 << 30):.1f}",
                   f"{row['rss_peak_bytes'] / (1 << 30):.1f}"]]),
        "", "Split by operation and step\n", ghost_table([row]), "",
        f"Command: python benchmarks/perf/profile_rectify.py --gpu-7b --evals {args.evals} --batch-size "
        f"{args.batch_size} --factor-dtype {args.factor_dtype}\n",
    ]
    text = "\n".join(lines)
    print(text)
    out_path = args.out or RESULTS / "gpu_7b.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"machine": machine_info(), "row": row}, indent=2) + "\n", encoding="utf-8")
    out_path.with_suffix(".md").write_text(text, encoding="utf-8")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args._run:
        spec = json.loads(Path(args._run).read_text(encoding="utf-8"))
        Path(args._result).write_text(json.dumps(run_one(spec)), encoding="utf-8")
        return
    if args.gpu_7b:
        run_gpu_7b(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
