"""Forgetting benchmark (GitHub issue 7): does JANUS give back memorized world knowledge after GSM8K fine-tuning?

    python -m benchmarks.forgetting.run            # full run (~25 min on 2 idle cores; +6 min to pretrain at first)
    python -m benchmarks.forgetting.run --quick    # smoke run (small everything, < 3 min)

1. "Pretrain" a Llama-style model of a few M parameters (BPE tokenizer trained on the data) until it has
   memorized NQ-open and WebQuestions question/answer pairs. Cached outside the repository (``lib.cache_dir``) and
   rebuilt, seeded, when absent.
2. Fine-tune it on GSM8K (question -> worked answer) with ``transformers.Trainer``: full FT, LoRA, PiSSA,
   each with ``hf_janus.JanusCallback`` (JANUS-F/-L/-P) replaying 256 memorized NQ-open pairs that are
   not in the evaluation sets.
3. Measure knowledge (greedy exact match + answer NLL on memorized, never-replayed NQ-open and WebQuestions
   pairs) and the new task (answer NLL on GSM8K test); AP1/AP2/AP as in the paper.
4. Baselines on the same θ̂: no rectification, WiSE-FT sweep, single-step JANUS (τ=0), average-gradient
   projection, τ=0.9, PEFT's intruder-dimension reduction (LoRA), spectral truncation of ΔW (rank sweep).

Writes benchmarks/forgetting/results/forgetting{_quick}.{json,md,png}. See README.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
# OpenMP threads that spin while waiting make every op ~10x slower as soon as another process uses a core
# (measured on the shared 2-core machine: 6.3 s vs 0.6 s per pretraining step); wait passively instead.
# Must be set before torch (libgomp) is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks.forgetting import lib, variants  # noqa: E402


@dataclass
class Settings:
    # data
    n_replay: int = 256
    n_eval: int = 256  # per knowledge set (NQ-open, WebQuestions)
    n_gsm_train: int = 3000
    n_gsm_test: int = 256
    qa_max_len: int = 64
    gsm_max_len: int = 192
    # tokenizer + model
    vocab: int = 4096
    # hidden 192 / MLP 512 (1.8M linear weights) made one Jacobian evaluation at m=256 cost ~30 s on this CPU
    # (the per-layer Grams are m² x d_in x d_out in float64), too slow for nine rectifications in 30 minutes.
    hidden: int = 128
    layers: int = 4
    intermediate: int = 256
    heads: int = 4
    # pretraining (memorization)
    pre_steps: int = 1200
    pre_lr: float = 3e-3
    pre_batch: int = 64
    # fine-tuning (Trainer)
    ft_steps: int = 200
    ft_batch: int = 16
    ft_lr: dict = field(default_factory=lambda: {"full": 5e-4, "lora": 2e-3, "pissa": 1e-3})
    lora_r: int = 8
    # JANUS
    tau: float = 0.95
    beta: float = 0.7
    janus_rank: int = 32
    replay_batch: int = 64
    # sweeps
    wise_a: tuple = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
    spectral_ranks: tuple = (1, 2, 4, 8, 16, 32)
    intruder_lambdas: tuple = (0.75, 0.5, 0.0)
    seed: int = 0
    # where the replayed pairs come from (lib.load_splits): only frontier_study.py --facts-replay uses another
    replay_pool: str = "nq_open_dev"

    def pretrain_key(self) -> str:
        keys = ("n_replay", "n_eval", "n_gsm_train", "qa_max_len", "vocab", "hidden", "layers", "intermediate",
                "heads", "pre_steps", "pre_lr", "pre_batch", "seed")
        # the default pool is left out of the key, so that the shipped checkpoint's key stays what it was
        keys += ("replay_pool",) if self.replay_pool != "nq_open_dev" else ()
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        digest = hashlib.sha256(blob.encode())
        names = ("nq_open_dev_subset.jsonl", "webquestions_trainmodel_subset.jsonl", "gsm8k_train_subset.jsonl")
        names += ("nq_open_dpr_dev_subset.jsonl",) if self.replay_pool == "nq_open_dpr" else ()
        for name in names:
            with open(os.path.join(lib.DATA_DIR, name), "rb") as fh:
                digest.update(fh.read())
        return digest.hexdigest()[:12]


QUICK = dict(n_replay=64, n_eval=64, n_gsm_train=400, n_gsm_test=48, gsm_max_len=128, vocab=2048, hidden=96,
             layers=2, intermediate=256, heads=4, pre_steps=300, ft_steps=40, ft_batch=8,
             wise_a=(0.5, 0.8), spectral_ranks=(1, 4), intruder_lambdas=(0.0,))

METHODS = {"full": "JANUS-F", "lora": "JANUS-L", "pissa": "JANUS-P"}
LOG = logging.getLogger("forgetting")


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------------
# pretraining (cached)
# ---------------------------------------------------------------------------------------------------------
def get_pretrained(s: Settings, splits: lib.Splits, cache_dir: str, tokenizer_only: bool = False):
    from transformers import LlamaForCausalLM

    folder = os.path.join(cache_dir, f"pretrained-{s.pretrain_key()}")
    tok_path = os.path.join(folder, "tokenizer.json")
    meta_path = os.path.join(folder, "meta.json")
    if os.path.isfile(meta_path):
        log(f"[pretrain] cached checkpoint {folder}")
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        tok = lib.Tok(tok_path)
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model.eval()
        return tok, model, folder, {**meta, "cached": True}
    t0 = time.perf_counter()
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    texts = [q.prompt + q.target for q in splits.memorized] + [m.prompt + m.target for m in splits.gsm_train]
    tok = lib.train_tokenizer(texts, s.vocab, os.path.join(tmp, "tokenizer.json"))
    samples = [lib.make_sample(tok, q.prompt, q.target, s.qa_max_len, label_prompt=True) for q in splits.memorized]
    model = lib.make_model(tok.vocab_size, tok, s.hidden, s.layers, s.intermediate, s.heads, s.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[pretrain] Llama {n_params / 1e6:.2f}M params (vocab {tok.vocab_size}); memorizing {len(samples)} QA pairs "
        f"for {s.pre_steps} steps")
    lib.pretrain(model, samples, s.pre_steps, s.pre_lr, s.pre_batch, s.seed, tok.pad_id, log=log)
    preds = lib.greedy_answers(model, tok, [q.prompt for q in splits.memorized], 16)
    meta = {"seconds": time.perf_counter() - t0, "params": n_params,
            "memorized_em_all": lib.exact_match(preds, splits.memorized),
            "memorized_em_replay": lib.exact_match(preds[: len(splits.replay)], splits.replay)}
    model.save_pretrained(tmp)
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    tok = lib.Tok(tok_path)
    log(f"[pretrain] done in {meta['seconds']:.0f}s; EM on all memorized pairs {meta['memorized_em_all']:.1f}%")
    return tok, model, folder, {**meta, "cached": False}


# ---------------------------------------------------------------------------------------------------------
# fine-tuning with Trainer + JanusCallback
# ---------------------------------------------------------------------------------------------------------
def make_snapshot_callback():
    from transformers import TrainerCallback

    from hf_janus.adapters.peft_layers import is_peft_model

    class KeepFinetuned(TrainerCallback):
        """Runs before JanusCallback at train end: keeps θ̂ (plain, merged for PEFT) and the PEFT model itself
        for the baselines; saves adapters for the JanusMerger fallback."""

        def __init__(self, work_dir: str):
            self.work_dir = work_dir
            self.finetuned = None
            self.peft_model = None
            self.train_seconds = 0.0
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, model=None, **kw):
            self._t0 = time.perf_counter()
            if is_peft_model(model):  # the initial adapter (PiSSA: needed to read the trained one back)
                model.save_pretrained(os.path.join(self.work_dir, "initial_adapter"))

        def on_train_end(self, args, state, control, model=None, **kw):
            self.train_seconds = time.perf_counter() - self._t0
            if is_peft_model(model):
                self.peft_model = copy.deepcopy(model)
                self.finetuned = variants.merged_copy(model)
                model.save_pretrained(os.path.join(self.work_dir, "adapter"))
            else:
                self.finetuned = copy.deepcopy(model)
            self.finetuned.eval()

    return KeepFinetuned


def finetune(method: str, s: Settings, tok: lib.Tok, base_dir: str, train: list[dict], replay: list[dict],
             janus_cfg, work_dir: str, force_merger: bool):
    """One Trainer run; returns θ̂ (plain), the JANUS-rectified plain model, the PEFT model, and a record.

    ``janus_cfg=None`` fine-tunes only (no rectification: the second model and the record's JANUS entries are None).
    """
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_janus import JanusCallback

    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if method != "full":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(r=s.lora_r, lora_alpha=2 * s.lora_r if method == "lora" else s.lora_r,
                          target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                          init_lora_weights=True if method == "lora" else "pissa")
        torch.manual_seed(s.seed)
        model = get_peft_model(model, lcfg)
    args = TrainingArguments(
        output_dir=work_dir, per_device_train_batch_size=s.ft_batch, max_steps=s.ft_steps,
        learning_rate=s.ft_lr[method], lr_scheduler_type="cosine", warmup_steps=max(1, s.ft_steps // 20),
        weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=max(1, s.ft_steps // 4), save_strategy="no", report_to="none", seed=s.seed, data_seed=s.seed,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
    )
    keep = make_snapshot_callback()(work_dir)
    has_peft_output = "peft_output" in inspect.signature(JanusCallback).parameters
    use_callback = janus_cfg is not None and (method == "full" or (has_peft_output and not force_merger))
    callbacks = [keep]
    janus_cb = None
    if use_callback:
        kwargs = {"peft_output": "merged"} if method != "full" else {}
        janus_cb = JanusCallback(replay, janus_cfg, **kwargs)
        callbacks.append(janus_cb)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=lib.Collator(tok.pad_id),
                      processing_class=tok.hf(), callbacks=callbacks)
    if janus_cb is not None:
        janus_cb.trainer = trainer
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    record = {"train_seconds": keep.train_seconds, "train_losses": losses}
    if janus_cfg is None:
        return keep.finetuned, None, keep.peft_model, record
    if use_callback:
        rectified = janus_cb.model
        report = janus_cb.report
        record["janus_path"] = ("JanusCallback (full fine-tuning)" if method == "full"
                                else "JanusCallback(peft_output='merged')")
        record["janus_seconds"] = total - keep.train_seconds
    else:
        from hf_janus import JanusMerger

        t1 = time.perf_counter()
        initial = os.path.join(work_dir, "initial_adapter") if method == "pissa" else None
        delta = JanusMerger(base_dir, os.path.join(work_dir, "adapter"), replay=replay, config=janus_cfg,
                            initial_adapter=initial, progress=False).run()
        rectified, report = delta.model, delta.report.rectification
        record["janus_path"] = "JanusMerger(base, adapter).run().model (fallback: JanusCallback has no peft_output)"
        record["janus_seconds"] = time.perf_counter() - t1
    rectified.eval()
    record["janus_report"] = summarize_report(report)
    return keep.finetuned, rectified, keep.peft_model, record


def summarize_report(report) -> dict:
    return {"steps": len(report.steps), "trials": report.num_trials, "alphas": report.alphas,
            "converged": report.converged, "stop_reason": report.stop_reason, "replay_loss": report.replay_loss,
            "jacobian_evals": report.num_jacobian_evals, "seconds": report.timings.get("total"),
            "max_residual": max((layer.residual for layer in report.layers if layer.residual is not None),
                                default=None)}


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model and data, < 3 minutes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="full,lora,pissa")
    ap.add_argument("--cache-dir", default=None,
                    help=f"pretrained checkpoints (default: ${lib.CACHE_ENV}, else "
                         "~/.cache/hf-janus/benchmarks/forgetting)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--step-control", default="adaptive", choices=("adaptive", "paper"),
                    help="JanusConfig.step_control of every JANUS run; the other controller is run once more on each "
                         "θ̂ at the main τ for the side-by-side table (default: adaptive)")
    ap.add_argument("--force-merger", action="store_true",
                    help="rectify LoRA/PiSSA with JanusMerger after training instead of JanusCallback")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_janus").setLevel(logging.WARNING)
    from hf_janus import JanusConfig
    from hf_janus.engine.layers import resolve_target_modules

    s = Settings(**(QUICK if args.quick else {}))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    splits = lib.load_splits(s.n_replay, s.n_eval, s.n_gsm_train, s.n_gsm_test)
    tok, pre_model, base_dir, pre_meta = get_pretrained(s, splits, args.cache_dir or lib.cache_dir())
    theta0_full = {k: v.detach().clone() for k, v in pre_model.state_dict().items()}

    qa_eval = lambda qs: [lib.make_sample(tok, q.prompt, q.target, s.qa_max_len, label_prompt=False) for q in qs]  # noqa: E731
    evaluate = lib.EvalSet(tok, splits.nq_eval, splits.wq_eval, qa_eval(splits.nq_eval), qa_eval(splits.wq_eval),
                           [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, False) for m in splits.gsm_test],
                           replay=splits.replay)
    # The replay: memorized NQ-open pairs disjoint from the evaluation pairs, with the pretraining loss (full text).
    replay = [lib.make_sample(tok, q.prompt, q.target, s.qa_max_len, label_prompt=True) for q in splits.replay]
    train = [lib.make_sample(tok, m.prompt, m.target, s.gsm_max_len, label_prompt=False) for m in splits.gsm_train]
    assert not {q.question for q in splits.replay} & {q.question for q in splits.nq_eval + splits.wq_eval}

    def cfg(tau: float, step_control: str = args.step_control):
        return JanusConfig(tau=tau, beta=s.beta, compression_rank=s.janus_rank, replay_batch_size=s.replay_batch,
                           seed=s.seed,
                           step_control=step_control)

    other_control = "paper" if args.step_control == "adaptive" else "adaptive"

    rows: dict[str, dict] = {}
    curves: dict[str, dict[str, list]] = {}
    records: dict[str, dict] = {}

    # Set per fine-tuning method: (θ̂, θ0 of the rectified layers, their names), for the ΔW kept/changed diagnostic.
    context: dict[str, object] = {}

    def add(name: str, method: str, kind: str, model, extra=None) -> dict:
        t0 = time.perf_counter()
        # EM on the replayed pairs separates "the constraints do not hold" from "they do not transfer to the
        # pairs that were not replayed"; the sweeps skip it to keep the run short.
        m = evaluate(model, with_replay=kind not in ("wise", "spectral"))
        if context:
            m["update_kept"], m["update_changed"] = variants.update_change(model, context["finetuned"],
                                                                           context["theta0"], context["names"])
        rows[name] = {"method": method, "kind": kind, **m, **(extra or {}), "eval_seconds": time.perf_counter() - t0}
        log(f"  {name:<34} NQ EM {m['nq_em']:5.1f}  WQ EM {m['wq_em']:5.1f}  NQ NLL {m['nq_nll']:.3f}  "
            f"WQ NLL {m['wq_nll']:.3f}  GSM8K NLL {m['gsm_nll']:.3f}")
        return rows[name]

    log("[eval] pretrained θ0")
    add("pretrained θ0", "-", "reference", pre_model,
        {"memorized_em_all": pre_meta.get("memorized_em_all")})

    with tempfile.TemporaryDirectory(prefix="janus-forgetting-") as tmp:
        for method in methods:
            label = {"full": "Full FT", "lora": "LoRA", "pissa": "PiSSA"}[method]
            log(f"[{label}] fine-tuning on GSM8K ({s.ft_steps} steps) with JanusCallback(τ={s.tau})")
            work = os.path.join(tmp, method)
            finetuned, rectified, peft_model, rec = finetune(method, s, tok, base_dir, train, replay, cfg(s.tau), work,
                                                             args.force_merger)
            records[method] = rec
            log(f"  trained in {rec['train_seconds']:.0f}s; JANUS via {rec['janus_path']} "
                f"in {rec['janus_seconds']:.0f}s: {rec['janus_report']['steps']} step(s), "
                f"α={['%.3g' % a for a in rec['janus_report']['alphas']]}")
            if method == "full":
                names = list(resolve_target_modules(finetuned, "all-linear"))
            else:
                from hf_janus.adapters.peft_layers import adapted_linear_layers

                names = list(adapted_linear_layers(peft_model))
            rec["target_layers"] = len(names)
            theta0 = {n + ".weight": theta0_full[n + ".weight"] for n in names}
            janus = METHODS[method]
            context.update(finetuned=finetuned, theta0=theta0, names=names)
            add(f"{label}", method, "finetuned", finetuned)
            add(f"{janus} (τ={s.tau}, callback)", method, "janus", rectified, {"report": rec["janus_report"]})
            # The same θ̂ and θ0 through the other step-size controller, for the side-by-side table.
            for tau, kind, name, control in (
                    (s.tau, "janus_other_control", f"{janus} (τ={s.tau}, {other_control} controller)", other_control),
                    (0.9, "janus_tau0.9", f"{janus} (τ=0.9)", args.step_control),
                    (0.0, "janus_single_step", f"{janus} (τ=0)", args.step_control)):
                t0 = time.perf_counter()
                model, report = variants.rectify_copy(finetuned, theta0, replay, cfg(tau, control))
                add(name, method, kind, model,
                    {"report": summarize_report(report), "rectify_seconds": time.perf_counter() - t0})
            t0 = time.perf_counter()
            model, info = variants.avg_grad_project(finetuned, theta0, names, replay, tok.pad_id, s.replay_batch)
            add(f"{janus} avg. gradient (single step)", method, "avg_grad", model,
                {**info, "rectify_seconds": time.perf_counter() - t0})
            add(f"{label}: rectified layers reset to θ0", method, "reset_linear",
                variants.reset_linear(finetuned, theta0, names))
            if method == "lora":
                reduction = variants.intruder_reduction(finetuned, theta0, names, s.lora_r)
                for lam in s.intruder_lambdas:
                    add(f"LoRA + intruder reduction (λ={lam:g})", method, "intruder",
                        variants.intruder_reduced(finetuned, theta0, reduction, lam),
                        {"mitigation_lambda": lam, "layers_with_intruders": reduction.layers_with_intruders,
                         "layers": len(reduction.layers)})
            curves[method] = {"wise": [], "spectral": []}
            for a in s.wise_a:
                r = add(f"{label} WiSE-FT a={a:g}", method, "wise", variants.wise_ft(pre_model, finetuned, a), {"a": a})
                curves[method]["wise"].append(r)
            max_rank = 2 * s.lora_r if method == "pissa" else (s.lora_r if method == "lora" else 10**9)
            for k in s.spectral_ranks:
                if k >= max_rank:
                    continue
                r = add(f"{label} spectral top-{k}", method, "spectral",
                        variants.spectral_truncate(finetuned, theta0, names, k), {"rank": k})
                curves[method]["spectral"].append(r)
            context.clear()
            del finetuned, rectified, peft_model

    # ---- metrics ------------------------------------------------------------------------------------------
    pre = rows["pretrained θ0"]
    ff = rows.get("Full FT")
    for r in rows.values():
        r.update(lib.ap_metrics(r, pre, ff))
    goals = {}
    for method in methods:
        label = {"full": "Full FT", "lora": "LoRA", "pissa": "PiSSA"}[method]
        base, jr = rows[label], rows[f"{METHODS[method]} (τ={s.tau}, callback)"]
        wise_pts = [(r["a"], r["ap2"], r["ap1"]) for r in curves[method]["wise"]]
        margin = (variants.above_wise((jr["ap2"], jr["ap1"]), (0.0, pre["ap1"]), (base["ap2"], base["ap1"]), wise_pts)
                  if ff else None)
        goals[METHODS[method]] = {
            "ap1_lift": jr["ap1"] - base["ap1"], "ap2": jr.get("ap2"),
            "above_wise_by": margin,
            "lift_ge_20": jr["ap1"] - base["ap1"] >= 20, "ap2_ge_90": (jr.get("ap2") or 0) >= 90,
            "above_wise": margin is not None and margin > 0,
        }
    controllers = {}
    for method in methods:
        label, janus = {"full": "Full FT", "lora": "LoRA", "pissa": "PiSSA"}[method], METHODS[method]
        for control, name in ((args.step_control, f"{janus} (τ={s.tau}, callback)"),
                              (other_control, f"{janus} (τ={s.tau}, {other_control} controller)")):
            r = rows[name]
            controllers.setdefault(janus, {})[control] = {
                "row": name, "ap1": r.get("ap1"), "ap2": r.get("ap2"), "evals": r["report"]["jacobian_evals"],
                "steps": r["report"]["steps"], "seconds": r["report"]["seconds"],
                "replay_loss": r["report"]["replay_loss"].get("rectified")}
    wall = time.perf_counter() - t_start
    result = {
        "settings": dataclasses.asdict(s), "quick": args.quick, "wall_seconds": wall,
        "step_control": args.step_control, "controllers": controllers,
        "pretrain": pre_meta, "finetune": records, "rows": rows, "goals": goals,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "peft": __import__("peft").__version__, "threads": args.threads,
                        "python": platform.python_version(), "loadavg_start": load_start,
                        "loadavg_end": os.getloadavg(), "cpus": os.cpu_count()},
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "forgetting_quick" if args.quick else "forgetting")
    with open(stem + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, default=float)
    md = render_markdown(result, methods)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(md)
    plot(result, methods, stem + ".png")
    print(md)
    log(f"wall time {wall:.0f}s; wrote {stem}.json/.md/.png")
    return 0


# ---------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------
def _f(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def render_markdown(result: dict, methods: list[str]) -> str:
    rows, s = result["rows"], result["settings"]
    lines = ["| model | NQ EM | WQ EM | NQ NLL | WQ NLL | GSM8K NLL | AP1 (%) | AP2 (%) | AP (%) | replay EM "
             "| ΔW kept | ΔW changed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    sweep_lines = list(lines)
    for name, r in rows.items():
        line = (f"| {name} | {r['nq_em']:.1f} | {r['wq_em']:.1f} | {r['nq_nll']:.3f} | {r['wq_nll']:.3f} | "
                f"{r['gsm_nll']:.3f} | {_f(r.get('ap1'))} | {_f(r.get('ap2'))} | {_f(r.get('ap'))} | "
                f"{_f(r.get('replay_em'))} | {_f(r.get('update_kept'), '{:.2f}')} | "
                f"{_f(r.get('update_changed'), '{:.2f}')} |")
        (sweep_lines if r["kind"] in ("wise", "spectral") else lines).append(line)
    out = ["## Main results", "", *lines, "", "## Sweeps (WiSE-FT, spectral truncation)", "", *sweep_lines, ""]
    out += ["## Goals (JANUS at τ=%g through JanusCallback)" % s["tau"], "",
            "| variant | AP1 lift over unrectified (≥ 20) | AP2 (≥ 90%) | above WiSE-FT curve by (AP1 points) | met |",
            "|---|---:|---:|---:|---|"]
    for name, g in result["goals"].items():
        met = g["lift_ge_20"] and g["ap2_ge_90"] and g["above_wise"]
        out.append(f"| {name} | {g['ap1_lift']:+.1f} | {_f(g['ap2'])} | {_f(g['above_wise_by'], '{:+.1f}')} | "
                   f"{'yes' if met else 'no'} |")
    out += ["", "## Step-size controllers (JANUS at τ=%g, the same θ̂ and θ0)" % s["tau"], "",
            "| variant | controller | Jacobian evals | steps | rectification (s) | AP1 (%) | AP2 (%) "
            "| replay loss after |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for janus, by_control in result.get("controllers", {}).items():
        for control, c in sorted(by_control.items()):
            out.append(f"| {janus} | {control} | {c['evals']} | {c['steps']} | {_f(c['seconds'], '{:.0f}')} | "
                       f"{_f(c['ap1'])} | {_f(c['ap2'])} | {_f(c['replay_loss'], '{:.3f}')} |")
        if {"adaptive", "paper"} <= set(by_control):
            a, p = by_control["adaptive"], by_control["paper"]
            out.append(f"| {janus} | paper / adaptive | {p['evals'] / a['evals']:.2f}× | | "
                       f"{_f(p['seconds'] / a['seconds'] if a['seconds'] else None, '{:.2f}×')} | "
                       f"{_f(a['ap1'] - p['ap1'], '{:+.1f}')} | {_f(a['ap2'] - p['ap2'], '{:+.1f}')} | |")
    out += ["", "JANUS paths: " + "; ".join(f"{m}: {result['finetune'][m]['janus_path']}" for m in methods),
            f"Wall time {result['wall_seconds']:.0f}s "
            f"(pretraining {'cached' if result['pretrain'].get('cached') else 'included'}).", ""]
    return "\n".join(out)


def plot(result: dict, methods: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    pre = rows["pretrained θ0"]
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 4.6), squeeze=False)
    markers = {"finetuned": ("X", "black", "no rectification"),
               "janus": ("*", "tab:red", "JANUS τ=%g (callback)" % result["settings"]["tau"]),
               "janus_other_control": ("*", "tab:pink", "JANUS τ=%g, %s controller" % (
                   result["settings"]["tau"],
                   "paper" if result.get("step_control", "adaptive") == "adaptive" else "adaptive")),
               "janus_tau0.9": ("P", "tab:orange", "JANUS τ=0.9"),
               "janus_single_step": ("v", "tab:purple", "JANUS τ=0 (single step)"),
               "avg_grad": ("s", "tab:brown", "avg.-gradient projection"),
               "intruder": ("D", "tab:cyan", "intruder reduction"),
               "reset_linear": ("o", "tab:gray", "rectified layers reset to θ0")}
    for ax, method in zip(axes[0], methods):
        sub = [r for r in rows.values() if r["method"] == method]
        base = next(r for r in sub if r["kind"] == "finetuned")
        wise = sorted([(0.0, pre["ap1"])] + [(r["ap2"], r["ap1"]) for r in sub if r["kind"] == "wise"]
                      + [(base["ap2"], base["ap1"])])
        ax.plot(*zip(*wise), "-o", color="tab:blue", ms=4, label="WiSE-FT θ0 + a(θ̂−θ0)")
        spec = sorted((r["ap2"], r["ap1"]) for r in sub if r["kind"] == "spectral")
        if spec:
            ax.plot(*zip(*spec), "--^", color="tab:green", ms=4, label="spectral top-k of ΔW")
        for kind, (mk, color, label) in markers.items():
            pts = [(r["ap2"], r["ap1"]) for r in sub if r["kind"] == kind]
            if pts:
                ax.scatter(*zip(*pts), marker=mk, color=color, s=110 if mk == "*" else 45, zorder=3, label=label)
        ax.set_title({"full": "Full FT / JANUS-F", "lora": "LoRA / JANUS-L", "pissa": "PiSSA / JANUS-P"}[method])
        ax.set_xlabel("AP2: GSM8K NLL gain vs full FT (%)")
        ax.set_ylabel("AP1: knowledge EM vs θ0 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
