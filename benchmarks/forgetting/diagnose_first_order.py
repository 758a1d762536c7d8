"""How much of the forgetting is first-order? (issue 22, item 1: diagnose)

JANUS keeps each replay sample's loss unchanged to first order: J₀ΔW = 0, with J₀ the per-sample loss gradients
at θ0. Where the past task is well fit, those gradients are near zero and the forgetting is second-order, so the
projection removes almost nothing. This script measures that on tiny Llamas (the demo's model and data: NQ-open
questions as the past task, every token supervised; GSM8K as the new task), one per pretraining length, from a
loosely fit past task to a well-fit one:

- θ0's per-sample replay losses and per-sample gradient norms (over the adapted layers);
- the first-order prediction Σᵢ gᵢ·ΔW of the replay loss rise against the actual rise L(θ̂) − L(θ0);
- how much of the rise single-step JANUS (τ=0, no compression) undoes, and its first-order residual;
- the same with ``constraint_temperature`` T > 1 (the loss at a softer softmax as the constraint);
- variants (``--variants``): single-step and multi-step JANUS with the paper's loss constraint and with
  ``constraint="target_logit"`` or ``"logit_projections"`` (k = 2, 8, 32), and multi-step with the replay-loss
  acceptance test (``acceptance="loss"``, also with logit projections, and ``"both"`` with the τ test). For
  each: the share of the replay loss rise undone, the share of the new-task gain kept (GSM8K answers held out from
  the fine-tune), Jacobian evaluations and time, and the WiSE-FT curve at equal new-task gain: θ0 + a(θ̂ − θ0) with
  ``a`` chosen (linear interpolation on a grid) to keep the same share of the new-task gain, and the share of the
  replay rise it undoes there; and the hybrid "JANUS, then interpolation toward θ̂" (θ_J + b(θ̂ − θ_J), b on the
  same grid) against WiSE-FT at 90% of the new-task gain.

Each demo model: pretrain on the replayed QA pairs (``--pretrain-steps``), then a LoRA r=8 on every linear layer is
trained on GSM8K and merged (θ̂). ``--scenario facts`` / ``questions`` diagnoses the forgetting benchmark's θ0
instead (``frontier_study.py``'s scenarios, full fine-tuning on GSM8K, its 256-sample replay, 64 held-out GSM8K
answers). Replay loss = mean per-token NLL of the replayed samples.

Usage::

    python -m benchmarks.forgetting.diagnose_first_order            # ~8 min on 2 cores
    python -m benchmarks.forgetting.diagnose_first_order --scenario facts --max-evaluations 30 --variants ...
    python -m benchmarks.forgetting.diagnose_first_order --quick
    python -m benchmarks.forgetting.diagnose_first_order --plot results/first_order.json   # redraw a plot

Results: ``benchmarks/forgetting/results/first_order[_<scenario>].json`` and ``.png`` (per case: the WiSE-FT curve
and every variant, new-task gain kept against replay rise undone), and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def per_sample(model, samples, names):
    """Per-sample mean-token losses and gradients w.r.t. the weights ``names`` (one sample at a time)."""
    from hf_janus.replay.prepare import prepare_replay

    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    losses, grads = [], []
    for sample in samples:
        batch = prepare_replay([sample], 1)[0]
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        g = torch.autograd.grad(loss, [params[n] for n in names])
        losses.append(loss.item())
        grads.append({n: gi.detach().double() for n, gi in zip(names, g)})
    return torch.tensor(losses, dtype=torch.float64), grads


def replay_loss(model, samples):
    from hf_janus.demo import answer_nll

    return answer_nll(model, samples)


VARIANTS = {
    # label: (JanusConfig fields); multi-step variants run to convergence or to the evaluation budget
    "single-step loss": dict(tau=0.0),
    "single-step target_logit": dict(tau=0.0, constraint="target_logit"),
    "multi-step loss": dict(max_evaluations=60),
    "multi-step target_logit": dict(constraint="target_logit", max_evaluations=60),
    "single-step logit_projections k=8": dict(tau=0.0, constraint="logit_projections",
                                              constraint_options={"projections": 8}),
    "multi-step logit_projections k=8": dict(constraint="logit_projections", constraint_options={"projections": 8},
                                             max_evaluations=60),
    "multi-step loss, loss acceptance": dict(acceptance="loss", max_evaluations=60),
    "multi-step loss, both tests": dict(acceptance="both", max_evaluations=60),
    "single-step logit_projections k=2": dict(tau=0.0, constraint="logit_projections",
                                              constraint_options={"projections": 2}),
    "single-step logit_projections k=32": dict(tau=0.0, constraint="logit_projections",
                                               constraint_options={"projections": 32}),
    "multi-step logit_projections k=8, loss acceptance": dict(constraint="logit_projections",
                                                              constraint_options={"projections": 8},
                                                              acceptance="loss", max_evaluations=60),
}


def wise_ft_curve(theta0, tuned, replay, new_task, grid):
    """(a, replay loss, new-task loss) of θ0 + a(θ̂ − θ0) over every floating parameter (with θ0 a rectified model:
    the hybrid "JANUS, then interpolation toward θ̂")."""
    points = []
    start, end = theta0.state_dict(), tuned.state_dict()
    probe = copy.deepcopy(tuned)
    for a in grid:
        probe.load_state_dict({k: (start[k] + a * (end[k] - start[k])) if end[k].is_floating_point() else end[k]
                               for k in end})
        points.append((a, replay_loss(probe, replay), replay_loss(probe, new_task)))
    return points


def wise_at_equal_gain(curve, gain_share, r0, r1, n0, n1):
    """The share of the replay rise WiSE-FT undoes where it keeps ``gain_share`` of the new-task gain."""
    shares = [((n0 - n) / (n0 - n1), (r1 - r) / (r1 - r0)) for _, r, n in curve]
    shares.sort()
    for (g_lo, u_lo), (g_hi, u_hi) in zip(shares, shares[1:]):
        if g_lo <= gain_share <= g_hi and g_hi > g_lo:
            return u_lo + (u_hi - u_lo) * (gain_share - g_lo) / (g_hi - g_lo)
    return None


def undone_at_gain(curve, gain_share, r0, r1, n0, n1):
    """Walking ``curve`` (ordered by its interpolation weight, toward θ̂) to the first point that keeps
    ``gain_share`` of the new-task gain: the share of the replay rise undone there, linearly interpolated between
    grid points (None if no point keeps that much)."""
    points = [((n0 - n) / (n0 - n1), (r1 - r) / (r1 - r0)) for _, r, n in curve]
    for k, (gain, undone) in enumerate(points):
        if gain >= gain_share:
            if k == 0:
                return undone
            g_lo, u_lo = points[k - 1]
            return u_lo + (undone - u_lo) * (gain_share - g_lo) / (gain - g_lo)
    return None


def demo_case(pretrain_steps: int, args):
    """The demo's setup: a tiny Llama pretrained on ``args.m`` NQ-open questions for ``pretrain_steps``, then a LoRA
    r=8 on every linear layer trained on GSM8K and merged. Returns (θ0, θ̂, replay, new-task held-out answers)."""
    from peft import LoraConfig, get_peft_model

    from hf_janus.demo import full_text, math_samples, qa_samples, tiny_llama, train

    replay = full_text(qa_samples(args.m, max_len=64))
    new_task = math_samples(0, 64, max_len=96)
    held_out = math_samples(64, 32, max_len=96)  # the new task's validation answers
    model = tiny_llama(seed=0)
    train(model, replay, steps=pretrain_steps, lr=args.pretrain_lr, batch_size=8, seed=0, desc="pretrain",
          progress=False)
    theta0 = copy.deepcopy(model)
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    train(lora, new_task, steps=args.finetune_steps, lr=args.lr, batch_size=8, seed=1, desc="fine-tune",
          progress=False)
    return theta0.eval(), lora.merge_and_unload().eval(), replay, held_out


def benchmark_case(scenario: str):
    """The forgetting benchmark's scenario (``frontier_study.py``: the cached θ0, full fine-tuning on GSM8K, seed 0).
    Returns (θ0, θ̂, its 256-sample replay, 64 held-out GSM8K answers)."""
    import tempfile

    from benchmarks.forgetting import lib
    from benchmarks.forgetting.frontier_study import MAIN_REPLAY, finetune, scenario_facts, scenario_questions
    from benchmarks.forgetting.run import Settings

    s = Settings()
    with tempfile.TemporaryDirectory(prefix="janus-diagnose-") as folder:
        if scenario == "facts":
            tok, theta0, gsm_train, _, _, replays = scenario_facts(s, folder)
        else:
            tok, theta0, gsm_train, _, _, replays = scenario_questions(s, folder, lib.cache_dir())
    splits = lib.load_splits(s.n_replay, s.n_eval, s.n_gsm_train, s.n_gsm_test, s.replay_pool)
    train = [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, label_prompt=False) for m in gsm_train]
    held_out = [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, label_prompt=False)
                for m in splits.gsm_test[:64]]
    tuned = finetune(theta0, train, s, "full", 0, tok.pad_id)
    return theta0.eval(), tuned.eval(), replays[MAIN_REPLAY], held_out


def run_case(label, theta0, tuned, replay, held_out, args, rank=None) -> dict:
    """The diagnosis of one (θ0, θ̂, replay, held-out new task); JANUS at compression ``rank`` (None: exact)."""
    from hf_janus import JanusConfig, JanusError, rectify

    names = [n for n, p in tuned.named_parameters() if n.endswith("proj.weight")]
    losses0, grads0 = per_sample(theta0, replay, names)
    losses1, _ = per_sample(tuned, replay, names)
    delta = {n: (dict(tuned.named_parameters())[n] - dict(theta0.named_parameters())[n]).detach().double()
             for n in names}
    predicted = torch.tensor([sum(float((g[n] * delta[n]).sum()) for n in names) for g in grads0])
    grad_norms = torch.tensor([sum(float(g[n].pow(2).sum()) for n in names) ** 0.5 for g in grads0])
    rise = losses1 - losses0
    reference = theta0.state_dict()
    r0, r1 = replay_loss(theta0, replay), replay_loss(tuned, replay)
    by_temperature = {}
    for temperature in args.temperatures:
        rectified = copy.deepcopy(tuned)
        start = time.perf_counter()
        config = JanusConfig(tau=0.0, compression_rank=rank, replay_batch_size=16,
                             constraint_options={"temperature": temperature})
        rectify(rectified, reference, replay, config, progress=False)
        r = replay_loss(rectified, replay)
        by_temperature[str(temperature)] = {"replay_loss": r,
                                            "undone_share": (r1 - r) / (r1 - r0) if r1 != r0 else None,
                                            "seconds": time.perf_counter() - start}
    rectified = copy.deepcopy(tuned)
    start = time.perf_counter()
    report = rectify(rectified, reference, replay, JanusConfig(tau=0.0, compression_rank=rank, replay_batch_size=16),
                     progress=False)
    seconds = time.perf_counter() - start
    r2 = replay_loss(rectified, replay)
    residual = max((s.residual for s in report.layers if s.residual is not None), default=None)

    n0, n1 = replay_loss(theta0, held_out), replay_loss(tuned, held_out)
    curve = wise_ft_curve(theta0, tuned, replay, held_out, [i / 10 for i in range(11)])
    variants = {}
    for name in args.variants:
        rectified = copy.deepcopy(tuned)
        start = time.perf_counter()
        try:
            run = rectify(rectified, reference, replay, JanusConfig(compression_rank=rank, replay_batch_size=16,
                                                                    **VARIANTS[name]),
                          progress=False)
        except JanusError as exc:  # e.g. a memory plan that does not fit: recorded, the other variants still run
            variants[name] = {"refused": str(exc)}
            print(f"[{label}] {name}: refused: {exc}", flush=True)
            continue
        r, n = replay_loss(rectified, replay), replay_loss(rectified, held_out)
        gain = (n0 - n) / (n0 - n1) if n0 != n1 else None
        # the hybrid: the rectified model interpolated toward θ̂, read at the new-task gain WiSE-FT is asked for
        hybrid = wise_ft_curve(rectified, tuned, replay, held_out, [i / 10 for i in range(11)])
        variants[name] = {
            "replay_loss": r, "new_task_loss": n, "undone_share": (r1 - r) / (r1 - r0) if r1 != r0 else None,
            "new_task_gain_kept": gain, "evaluations": run.num_jacobian_evals, "steps": len(run.steps),
            "stop_reason": run.stop_reason, "seconds": time.perf_counter() - start,
            "wise_ft_undone_at_equal_gain": None if gain is None else wise_at_equal_gain(curve, gain, r0, r1, n0, n1),
            "hybrid_toward_finetuned": [{"b": b, "replay_loss": hr, "new_task_loss": hn} for b, hr, hn in hybrid],
            "hybrid_undone_at_90pct_gain": undone_at_gain(hybrid, 0.9, r0, r1, n0, n1),
        }
        print(f"[{label}] {name}: undone {variants[name]['undone_share']}, gain kept {gain}, "
              f"{run.num_jacobian_evals} evaluations, {variants[name]['seconds']:.0f} s", flush=True)
    return {
        "wise_ft_undone_at_90pct_gain": undone_at_gain(curve, 0.9, r0, r1, n0, n1),
        "new_task_loss": {"theta0": n0, "finetuned": n1},
        "wise_ft_curve": [{"a": a, "replay_loss": r, "new_task_loss": n} for a, r, n in curve],
        "variants": variants,
        "single_step_by_constraint_temperature": by_temperature,
        "case": label, "rank": rank, "replay_samples": len(replay),
        "replay_loss": {"theta0": r0, "finetuned": r1, "single_step_janus": r2},
        "per_sample_loss_theta0": {"mean": float(losses0.mean()), "min": float(losses0.min()),
                                   "max": float(losses0.max())},
        "per_sample_grad_norm_theta0": {"mean": float(grad_norms.mean()), "min": float(grad_norms.min()),
                                        "max": float(grad_norms.max())},
        "rise_actual_mean": float(rise.mean()), "rise_first_order_mean": float(predicted.mean()),
        "first_order_share": float(predicted.mean() / rise.mean()) if float(rise.mean()) != 0 else None,
        "first_order_correlation": float(torch.corrcoef(torch.stack([predicted, rise]))[0, 1]),
        "single_step_undone_share": (r1 - r2) / (r1 - r0) if r1 != r0 else None,
        "single_step_first_order_residual_max": residual, "single_step_seconds": seconds,
    }


def plot(rows: list[dict], path: Path) -> None:
    """One panel per case: the WiSE-FT curve and each variant, as (new-task gain kept, replay rise undone), with the
    issue's goal region (≥ 90% kept, ≥ 80% undone) shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 4.8), squeeze=False)
    for ax, r in zip(axes[0], rows):
        r0, r1 = r["replay_loss"]["theta0"], r["replay_loss"]["finetuned"]
        n0, n1 = r["new_task_loss"]["theta0"], r["new_task_loss"]["finetuned"]
        wise = [(100 * (n0 - p["new_task_loss"]) / (n0 - n1), 100 * (r1 - p["replay_loss"]) / (r1 - r0))
                for p in r["wise_ft_curve"]]
        ax.plot(*zip(*wise), "-o", color="black", ms=3, label="WiSE-FT θ0 + a(θ̂ − θ0)")
        ax.fill_between([90, 105], 80, 105, color="tab:green", alpha=0.15, label="issue 22's goal")
        for k, (label, v) in enumerate(r["variants"].items()):
            if v.get("new_task_gain_kept") is None or v.get("undone_share") is None:
                continue
            marker = "s" if label.startswith("single") else "^"
            ax.plot(100 * v["new_task_gain_kept"], 100 * v["undone_share"], marker, color=plt.cm.tab20(k % 20), ms=7,
                    label=f"{label} ({v['evaluations']} evals)")
        case = r.get("case", r["pretrain_steps"])
        ax.set_title(f"{case}: replay loss {r0:.3f} → {r1:.3f}", fontsize=9)
        ax.set_xlabel("new-task gain kept (%)")
        ax.set_ylabel("replay loss rise undone (%)")
        ax.set_xlim(-5, 105)
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=("demo", "facts", "questions"), default="demo",
                    help="demo: tiny Llamas pretrained for --pretrain-steps; facts/questions: the forgetting "
                         "benchmark's θ0 and its full fine-tuning (frontier_study.py), replay m=256")
    ap.add_argument("--pretrain-steps", type=int, nargs="+", default=[40, 150, 600],
                    help="pretraining lengths: loosely to well fit past task (default: %(default)s)")
    ap.add_argument("--pretrain-lr", type=float, default=1e-2, help="pretraining learning rate")
    ap.add_argument("--finetune-steps", type=int, default=150)
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default: results/first_order.json)")
    ap.add_argument("--lr", type=float, default=2e-3, help="LoRA learning rate")
    ap.add_argument("--m", type=int, default=16, help="replay samples")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[2.0, 4.0, 8.0],
                    help="constraint_temperature values for single-step JANUS (default: %(default)s)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="JANUS variants compared with WiSE-FT (default: all)")
    ap.add_argument("--max-evaluations", type=int, default=None,
                    help="budget of every multi-step variant (default: 60)")
    ap.add_argument("--quick", action="store_true", help="two short cases")
    ap.add_argument("--plot", type=Path, nargs="+", default=None, metavar="JSON",
                    help="only draw the plot of these result files (next to each, .png)")
    args = ap.parse_args(argv)
    from benchmarks.forgetting.run import Settings

    if args.plot:
        for path in args.plot:
            plot(json.loads(path.read_text())["cases"], path.with_suffix(".png"))
        return
    if args.max_evaluations is not None:
        for label in args.variants:
            if "max_evaluations" in VARIANTS[label]:
                VARIANTS[label]["max_evaluations"] = args.max_evaluations
    if args.quick:
        args.pretrain_steps, args.finetune_steps = [20, 80], 40
    if args.scenario == "demo":
        rows = [{**run_case(f"{steps} pretraining steps", *demo_case(steps, args), args), "pretrain_steps": steps}
                for steps in args.pretrain_steps]
    else:
        # the benchmark's compression (rank 32): exact factors of 256 samples would not fit 24 GiB
        rows = [{**run_case(args.scenario, *benchmark_case(args.scenario), args, rank=Settings().janus_rank),
                 "pretrain_steps": args.scenario}]
    print(f"First-order share of the forgetting (tiny Llama, LoRA r=8 all-linear merged, m={args.m})")
    print("| case | replay loss θ0 → θ̂ | mean ‖gᵢ‖ at θ0 | predicted / actual rise | corr | "
          "single-step JANUS undoes | its max ‖J₀ΔW_rect‖/‖J₀ΔW‖ |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        loss = r["replay_loss"]
        share, undone = r["first_order_share"], r["single_step_undone_share"]
        residual = r["single_step_first_order_residual_max"]
        print(f"| {r['pretrain_steps']} | {loss['theta0']:.3f} → {loss['finetuned']:.3f} | "
              f"{r['per_sample_grad_norm_theta0']['mean']:.3g} | {'-' if share is None else format(share, '.3f')} | "
              f"{r['first_order_correlation']:.2f} | {'-' if undone is None else format(100 * undone, '.1f') + '%'} | "
              f"{'-' if residual is None else format(residual, '.1e')} |")
    print("\nSingle-step JANUS, share of the replay loss rise undone, by constraint_temperature:")
    print("| case | T=1 | " + " | ".join(f"T={t:g}" for t in args.temperatures) + " |")
    print("|---|---|" + "---|" * len(args.temperatures))
    for r in rows:
        cells = [f"{100 * r['single_step_undone_share']:.1f}%"]
        cells += [f"{100 * r['single_step_by_constraint_temperature'][str(t)]['undone_share']:.1f}%"
                  for t in args.temperatures]
        print(f"| {r['pretrain_steps']} | " + " | ".join(cells) + " |")
    print("\nVariants against WiSE-FT at equal new-task gain (replay rise undone / new-task gain kept / evaluations):")
    print("| case | variant | rise undone | new-task gain kept | WiSE-FT undoes at that gain | evaluations | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for label, v in r["variants"].items():
            def pct(x):
                return "-" if x is None else f"{100 * x:.1f}%"
            if "refused" in v:
                print(f"| {r['pretrain_steps']} | {label} | refused: {v['refused'][:90]}… | | | | |")
                continue
            print(f"| {r['pretrain_steps']} | {label} | {pct(v['undone_share'])} | {pct(v['new_task_gain_kept'])} | "
                  f"{pct(v['wise_ft_undone_at_equal_gain'])} | {v['evaluations']} | {v['seconds']:.0f} |")
    print("\nAt 90% of the new-task gain: WiSE-FT against each rectified model interpolated toward θ̂ (hybrid):")
    print("| case | WiSE-FT undoes | " + " | ".join(f"hybrid {label}" for label in args.variants) + " |")
    print("|---|---|" + "---|" * len(args.variants))
    for r in rows:
        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"
        print(f"| {r['pretrain_steps']} | {pct(r['wise_ft_undone_at_90pct_gain'])} | "
              + " | ".join(pct(r["variants"][label].get("hybrid_undone_at_90pct_gain"))
                           for label in args.variants) + " |")
    RESULTS.mkdir(exist_ok=True)
    default = ("first_order" + ("" if args.scenario == "demo" else f"_{args.scenario}")
               + ("_quick" if args.quick else ""))
    target = args.out or RESULTS / f"{default}.json"
    target.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                  "cases": rows}, indent=2) + "\n")
    plot(rows, target.with_suffix(".png"))
    print(f"written to {target} and {target.with_suffix('.png')}")


if __name__ == "__main__":
    main()
