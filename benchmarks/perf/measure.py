"""What the performance benchmarks share: synthetic LLaMA-shaped models and fine-tunes, a fixed schedule of
Jacobian evaluations, timing per Rectifier step, peak memory, figures rewritten as a run goes, and runs in a fresh
interpreter (optionally with the engine of another git revision).

The parts of the retired ``bench_ghost.py`` and ``profile_rectify.py`` that ``scale.py``, ``qlora.py``,
``ab_forgetting.py`` and ``compression_gpu.py`` still use; their result files stay in ``results/`` (see
``benchmarks/README.md``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import importlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
import torch
from torch import Tensor

import hf_janus

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------------
# Memory, CPU contention, the machine
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
        return (t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
                + getattr(t, "steal", 0.0))

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


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# Synthetic models, fine-tunes and replays
# ------------------------------------------------------------------------------------------------------

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
    ("rectifier", "Rectifier.repair", "repair"),
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


def wrap_engine(module_name: str, attr: str, make: Callable[[Callable], Callable]) -> Optional[Callable[[], None]]:
    """Replace the engine's ``attr`` (``"function"`` or ``"Class.method"`` of ``hf_janus.engine.<module_name>``) by
    ``make(original)``; returns the undo, or None where this engine has no such function (another engine version) or
    it is a static or class method (left alone)."""
    try:
        module = engine_module(module_name)
    except ModuleNotFoundError:  # a module of another engine version
        return None
    owner, name = module, attr
    if "." in attr:
        cls_name, name = attr.split(".")
        owner = getattr(module, cls_name, None)
    original = getattr(owner, name, None) if owner is not None else None
    if original is None or isinstance(owner.__dict__.get(name), (staticmethod, classmethod)):
        return None
    setattr(owner, name, make(original))
    return lambda: setattr(owner, name, original)


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
        undo = wrap_engine(module_name, attr, lambda fn: make(fn, label))
        if undo is not None:
            self._undo.append(undo)

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
# Runs in a fresh interpreter
# ------------------------------------------------------------------------------------------------------

def launch(spec: dict[str, Any], module: str, engine_dir: Optional[str] = None) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter as ``python -m module --_run SPEC --_result RESULT`` (the module writes the
    result JSON); ``engine_dir`` (holding an ``hf_janus`` package) goes first on the path, the repository after it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (engine_dir, str(REPO), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        Path(spec_path).write_text(json.dumps(spec), encoding="utf-8")
        # Run from a neutral directory so the repository checkout does not shadow engine_dir.
        subprocess.run([sys.executable, "-m", module, "--_run", spec_path, "--_result", result_path], check=True,
                       env=env, cwd=tmp)
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
