"""Two engine versions on the forgetting benchmark's own rectification, alternating in one invocation (issue 7).

    python -m benchmarks.perf.ab_forgetting --baseline 82eef97            # baseline commit vs the working tree
    python -m benchmarks.perf.ab_forgetting --baseline 82eef97 --repeats 3 --tau 0.9

The forgetting benchmark spends most of its time in JANUS at m=256 on short QA replay (28 layers of 16-33K weights),
a regime the model-size sweep of ``scale.py`` does not cover. This script takes the benchmark's pretrained
checkpoint (pretraining it first if the benchmark's cache, ``lib.cache_dir()``, lacks it), fine-tunes it on GSM8K
with full fine-tuning exactly as the benchmark does (θ̂ is cached beside the checkpoint), and rectifies θ̂ with the
benchmark's JanusConfig in fresh processes: the ``--baseline`` engine (``git archive REV hf_janus``) and the working
tree's, alternating, so that both see the same machine. Machines are noisy: compare the ratios of one invocation.

Prints a table and writes ``results/ab_forgetting.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# Set before torch loads libgomp, as the benchmark does (spinning OpenMP waits on a shared 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _setup(cache_dir: str, threads: int):
    """The benchmark's settings, data, checkpoint and replay; θ̂ of full fine-tuning (cached)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from benchmarks.forgetting import lib, run

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    s = run.Settings()
    splits = lib.load_splits(s.n_replay, s.n_eval, s.n_gsm_train, s.n_gsm_test)
    tok, pre_model, base_dir, _ = run.get_pretrained(s, splits, cache_dir)
    replay = [lib.make_sample(tok, q.prompt, q.target, s.qa_max_len, label_prompt=True) for q in splits.replay]
    # Beside the checkpoint, not in it: the checkpoint folder is the benchmark's own (and ships with the repository).
    path = f"{base_dir}-finetuned-full-{s.ft_steps}-{s.ft_lr['full']:g}.safetensors"
    if not os.path.isfile(path):
        train = [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, label_prompt=False) for m in splits.gsm_train]
        with tempfile.TemporaryDirectory() as work:
            finetuned, _, _, _ = run.finetune("full", s, tok, base_dir, train, replay, None, work, False)
        tmp = path + ".tmp"
        save_file({k: v.contiguous() for k, v in finetuned.state_dict().items()}, tmp)
        os.replace(tmp, path)
    finetuned = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    finetuned.load_state_dict(load_file(path))
    return s, pre_model, finetuned, replay


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from benchmarks.forgetting import variants

    import hf_janus
    from hf_janus import JanusConfig, resolve_target_modules

    s, pre_model, finetuned, replay = _setup(spec["cache_dir"], spec["threads"])
    names = list(resolve_target_modules(finetuned, "all-linear"))
    reference = pre_model.state_dict()
    theta0 = {n + ".weight": reference[n + ".weight"].clone() for n in names}
    cfg = JanusConfig(tau=spec["tau"], beta=s.beta, compression_rank=s.janus_rank, replay_batch_size=s.replay_batch,
                      seed=s.seed)
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    _, report = variants.rectify_copy(finetuned, theta0, replay, cfg)
    return {
        "engine_file": hf_janus.__file__, "wall_seconds": time.perf_counter() - start_wall,
        "cpu_seconds": time.process_time() - start_cpu, "timings": report.timings,
        "jacobian_evals": report.num_jacobian_evals, "alphas": report.alphas,
        "replay_loss_rectified": report.replay_loss["rectified"],
        "max_residual": max((layer.residual for layer in report.layers if layer.residual is not None), default=None),
        "torch_threads": torch.get_num_threads(),
    }


def table(runs: list[dict[str, Any]]) -> str:
    from benchmarks.perf.measure import md_table

    rows = []
    for r in runs:
        t = r["timings"]
        rows.append([r["engine"], f"{r['wall_seconds']:.1f}", f"{r['cpu_seconds']:.1f}",
                     f"{t.get('compression', 0):.1f}", f"{t.get('forward_backward', 0):.1f}",
                     f"{t.get('ghost', 0):.1f}", str(r["jacobian_evals"]), f"{r['replay_loss_rectified']:.6f}",
                     f"{r['max_residual']:.2e}"])
    return md_table(["engine", "wall s", "CPU s", "compression s", "fwd+bwd s", "ghost s", "Jacobian evals",
                     "replay loss after", "max residual"], rows)


def summary(runs: list[dict[str, Any]]) -> str:
    def mean(engine: str, key: str) -> float:
        vals = [r[key] for r in runs if r["engine"] == engine]
        return sum(vals) / len(vals)

    base, cur = runs[0]["engine"], runs[1]["engine"]
    return (f"Mean wall {mean(base, 'wall_seconds'):.1f} s → {mean(cur, 'wall_seconds'):.1f} s "
            f"({mean(base, 'wall_seconds') / mean(cur, 'wall_seconds'):.2f}x), CPU {mean(base, 'cpu_seconds'):.1f} s → "
            f"{mean(cur, 'cpu_seconds'):.1f} s ({mean(base, 'cpu_seconds') / mean(cur, 'cpu_seconds'):.2f}x).")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="git revision of the engine to compare against (required)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine, alternating (default: %(default)s)")
    ap.add_argument("--tau", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=None, help="the benchmark's checkpoints (default: its own cache)")
    ap.add_argument("--out", type=Path, default=RESULTS / "ab_forgetting.json")
    ap.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._run:
        spec = json.loads(Path(args._run).read_text(encoding="utf-8"))
        Path(args._result).write_text(json.dumps(child(spec), default=float), encoding="utf-8")
        return 0
    if not args.baseline:
        ap.error("--baseline REV is required")

    from benchmarks.perf.measure import engine_at, launch, machine_info

    from benchmarks.forgetting.lib import cache_dir

    spec = {"cache_dir": os.path.abspath(args.cache_dir or cache_dir()), "threads": args.threads, "tau": args.tau}
    print("preparing the checkpoint and θ̂ (cached after the first run) ...", flush=True)
    _setup(spec["cache_dir"], args.threads)
    runs = []
    with engine_at(args.baseline) as baseline_dir:
        for i in range(args.repeats):
            for engine, engine_dir in ((args.baseline, baseline_dir), ("working tree", None)):
                result = launch(spec, "benchmarks.perf.ab_forgetting", engine_dir)
                result["engine"] = engine
                runs.append(result)
                print(f"  [{i + 1}/{args.repeats}] {engine}: {result['wall_seconds']:.1f} s wall, "
                      f"{result['cpu_seconds']:.1f} s CPU, {result['jacobian_evals']} evaluations", flush=True)
    md = (f"Forgetting benchmark θ̂ (full fine-tuning), JANUS τ={args.tau}, {args.threads} torch threads, "
          f"engines alternating\n\n{table(runs)}\n\n{summary(runs)}\n")
    print("\n" + md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"baseline": args.baseline, "settings": spec, "runs": runs,
                                    "machine": machine_info()}, indent=2, default=float), encoding="utf-8")
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
