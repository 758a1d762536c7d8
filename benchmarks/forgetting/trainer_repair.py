"""The repair where users run it (issue 62's measurement): a ``transformers.Trainer`` fine-tunes SmolLM2-135M-Instruct
on GSM8K with ``JanusCallback(replay, JanusConfig(distill_steps=N))``, and the callback repairs the model at train end,
choosing its own point; nothing else is called. The past behaviour is scored on questions never replayed nor used to
choose (the callback chooses on slices of its own replay and of the Trainer's ``eval_dataset``).

    python -m benchmarks.forgetting.trainer_repair --run full --threads 2
    python -m benchmarks.forgetting.trainer_repair --run lora --threads 2
    python -m benchmarks.forgetting.trainer_repair --run qlora --threads 2  # LoRA on the nf4 base (float32 compute)
    python -m benchmarks.forgetting.trainer_repair --run full --replay self --tag data_free --threads 2
    python -m benchmarks.forgetting.trainer_repair --run lora --replay-size 256 --tag m256 --threads 2
    python -m benchmarks.forgetting.trainer_repair --run lora --save-finetuned DIR --threads 2  # θ̂'s adapter kept
    python -m benchmarks.forgetting.trainer_repair --merge DIR --threads 2  # that adapter through hf-janus merge
    python -m benchmarks.forgetting.trainer_repair --summarize

The data and the scoring are ``real_study.py``'s (θ0's answers, cached in ``cache/real_study/full``, generated when
missing): 64 of θ0's answers to NQ-open questions are the replay (``--replay-size M``: M of them; ``--replay self``:
``SelfReplay()``, no data), the fine-tuning is ``real_model.py``'s (GSM8K worked answers, 40 steps of 8, its
learning rates and LoRA) on the Trainer (linear schedule, 3 warm-up steps, float32 on the CPU), and the Trainer's
``eval_dataset`` is 16 GSM8K problems the fine-tune never sees. θ̂ is scored by a callback that runs just before
``JanusCallback`` at train end. Figures, as in ``real_study``: *EM back* is the share of θ0's answers lost by θ̂
(greedy, token for token) that the repaired model gives back; *AP2* the share of θ̂'s drop of the GSM8K test NLL it
keeps. Results: ``results/trainer_repair_<run>[_<tag>].{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks import smollm2  # noqa: E402
from benchmarks.forgetting import real_model as bench  # noqa: E402
from benchmarks.forgetting import real_study as study  # noqa: E402

from hf_janus import JanusCallback, JanusConfig, SelfReplay  # noqa: E402
from hf_janus.io_utils import atomic_write_text  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
SCORED = ("nq", "webq", "nq_held_out", "webq_held_out")  # none replayed, none seen by the callback's choice
log = bench.log


def theta0_data(s: bench.Settings, tok, theta0, work: str) -> dict:
    """θ0's answers (the replay pool, the scored and held-out questions), as ``real_study`` caches them."""
    path = os.path.join(work, "data.json")
    data = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    else:
        os.makedirs(work, exist_ok=True)
        data = study.own_behaviour(s, tok, theta0)

    def save() -> None:
        atomic_write_text(path, json.dumps(data))

    study.held_out_sets(s, tok, theta0, data, save)
    save()
    return data


class ScoreAtTrainEnd(TrainerCallback):
    """Placed before ``JanusCallback``: scores θ̂ at train end, before JANUS changes it; ``ended`` is when it was
    done (the rectification runs from then until ``train()`` returns)."""

    def __init__(self, score, save_to: str = ""):
        self.score, self.save_to = score, save_to
        self.figures: dict = {}
        self.seconds = 0.0
        self.ended = 0.0

    def on_train_end(self, args, state, control, model=None, **kwargs):
        start, training = time.perf_counter(), model.training
        self.figures = self.score(model)
        model.train(training)
        if self.save_to:  # θ̂ as the user saves it (a PEFT model: the adapter), for --merge
            model.save_pretrained(self.save_to)
        self.ended = time.perf_counter()
        self.seconds = self.ended - start
        log(f"[finetuned] {self.figures['past_summary']} gsm {self.figures['gsm_nll']:.4f} ({self.seconds:.0f}s)")


def fine_tune_arguments(s: bench.Settings, run: str, output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=s.ft_steps, per_device_train_batch_size=s.ft_batch,
        per_device_eval_batch_size=8, learning_rate=s.lr[run], lr_scheduler_type="linear", warmup_steps=3,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=10, save_strategy="no", report_to=[], use_cpu=True,
        seed=s.seed, data_seed=s.seed, disable_tqdm=True, remove_unused_columns=False)


def nf4_config(double_quant: bool = False):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_use_double_quant=double_quant)


def theta0_folder(run: str, work: str, double_quant: bool = False) -> str:
    """θ0 as the run's user has it, as a plain float32 folder: the model itself, or for ``qlora`` its nf4 base
    dequantized (saved in ``work`` once), so that θ0's answers and scores are those of the model the QLoRA starts
    from."""
    base_dir = os.fspath(smollm2.smollm2_dir())
    if run != "qlora":
        return base_dir
    folder = os.path.join(work, "base-nf4-dequantized")
    if not os.path.isdir(folder):
        from transformers import AutoModelForCausalLM

        quantized = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=nf4_config(double_quant),
                                                         dtype=torch.float32)
        bench.dequantized_base(quantized, folder, torch.float32)
    return folder


def trainer_model(run: str, s: bench.Settings, double_quant: bool = False):
    from transformers import AutoModelForCausalLM

    quant = {"quantization_config": nf4_config(double_quant)} if run == "qlora" else {}
    model = AutoModelForCausalLM.from_pretrained(os.fspath(smollm2.smollm2_dir()), dtype=torch.float32, **quant)
    if run in ("lora", "qlora"):
        from peft import get_peft_model

        model = get_peft_model(model, bench.lora_config(s))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=("full", "lora", "qlora"), default="full")
    ap.add_argument("--replay", choices=("answers", "self"), default="answers",
                    help="the callback's replay: θ0's answers to NQ-open questions, or SelfReplay() (no data)")
    ap.add_argument("--replay-size", type=int, default=None, metavar="M",
                    help="samples replayed: θ0's answers (default 64; more are generated and cached when the pool "
                         "is short), or with --replay self SelfReplay(num_samples=M) (default: SelfReplay()'s, every "
                         "generic prompt once)")
    ap.add_argument("--distill-steps", type=int, default=128)
    ap.add_argument("--distill-lr", type=float, default=None,
                    help="default: the callback's, a tenth of the Trainer's learning rate (1e-5 full, 1e-4 LoRA)")
    ap.add_argument("--distill-schedule", default=None, help="JanusConfig.distill_schedule (none: its default)")
    ap.add_argument("--replay-batch-size", type=int, default=None,
                    help="JanusConfig.replay_batch_size, JANUS's batches (none: its default)")
    ap.add_argument("--distill-replay-batch-size", type=int, default=None,
                    help="JanusConfig.distill_replay_batch_size (none: its default)")
    ap.add_argument("--compression-rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--summarize", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 fine-tuning steps of 2, 2 distillation steps, 8 questions a set (no record)")
    ap.add_argument("--merge-validation", action="store_true",
                    help="with --merge: measure the gain on the callback's eval_dataset (--new-task-validation)")
    ap.add_argument("--work-dir", default=None,
                    help="θ0's answers (default: cache/real_study/full; for qlora, cache/real_study/qlora_f32)")
    ap.add_argument("--save-finetuned", default="", metavar="DIR",
                    help="also save θ̂ as the Trainer ends (LoRA: the adapter), with the replay and the new task's "
                         "samples as JSONL, for --merge")
    ap.add_argument("--merge", default="", metavar="DIR",
                    help="instead of training: repair the adapter --save-finetuned saved with `hf-janus merge "
                         "--new-task-samples`, as a user of a saved adapter would, and score its output adapter")
    ap.add_argument("--adapter-rank", default="same", help="with --merge: hf-janus merge's --adapter-rank")
    ap.add_argument("--double-quant", action="store_true",
                    help="qlora: nf4 with double quantization, the base `hf-janus merge --load-in-4bit` loads (needed "
                         "with --merge)")
    args = ap.parse_args()
    if args.summarize:
        print(write_markdown())
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer

    s = bench.Settings()
    if args.quick:
        s.ft_steps, s.ft_batch, args.distill_steps = 2, 2, 2
    torch.manual_seed(s.seed)
    tok = AutoTokenizer.from_pretrained(smollm2.smollm2_dir())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if args.work_dir is None:
        work = {"qlora": "qlora_dq_f32" if args.double_quant else "qlora_f32"}.get(args.run, "full")
        args.work_dir = os.path.join(HERE, "cache", "real_study", work)
    theta0 = AutoModelForCausalLM.from_pretrained(theta0_folder(args.run, args.work_dir, args.double_quant),
                                                  dtype=torch.float32).eval()
    data = theta0_data(s, tok, theta0, args.work_dir)
    # θ0's answers to replay (with --replay self, the study's number, which --save-finetuned writes for a --merge)
    answers = args.replay_size if args.replay == "answers" and args.replay_size else s.n_replay
    pool = study.replay_pool(s, data, answers, tok, theta0,
                             lambda: atomic_write_text(os.path.join(args.work_dir, "data.json"), json.dumps(data)))
    sets = {"nq": data["eval_nq"], "webq": data["eval_wq"], "nq_held_out": data["held_out_nq"],
            "webq_held_out": data["held_out_wq"]}
    gsm = data["gsm"]
    if args.quick:
        sets, gsm = {name: rows[:8] for name, rows in sets.items()}, gsm[:8]

    def score(model) -> dict:
        return study.evaluate(model, tok, sets, gsm, pad)

    t = time.perf_counter()
    scored = {"theta0": score(theta0)}
    log(f"[theta0] {scored['theta0']['past_summary']} gsm {scored['theta0']['gsm_nll']:.4f} "
        f"({time.perf_counter() - t:.0f}s)")
    del theta0
    if args.merge:
        merge_repair(args, score, scored, study.new_task_validation_samples(tok))
        return

    config = JanusConfig(compression_rank=args.compression_rank, distill_steps=args.distill_steps,
                         distill_lr=args.distill_lr,
                         **({"distill_schedule": args.distill_schedule} if args.distill_schedule else {}),
                         **({"replay_batch_size": args.replay_batch_size} if args.replay_batch_size else {}),
                         **({"distill_replay_batch_size": args.distill_replay_batch_size}
                            if args.distill_replay_batch_size else {}))
    if args.replay == "self":
        replay: Any = SelfReplay(**({"num_samples": args.replay_size} if args.replay_size else {}))
    else:
        replay = study.replay_samples(pool)
    if args.save_finetuned:
        os.makedirs(args.save_finetuned, exist_ok=True)
        files = {"replay": study.replay_samples(pool), "new_task": study.new_task_samples(tok)}
        for name, rows in files.items():
            atomic_write_text(os.path.join(args.save_finetuned, f"{name}.jsonl"),
                              "".join(json.dumps(r) + "\n" for r in rows))
    finetuned = ScoreAtTrainEnd(score, args.save_finetuned)
    janus = JanusCallback(replay, config)
    model = trainer_model(args.run, s, args.double_quant)
    collator_tok = AutoTokenizer.from_pretrained(smollm2.smollm2_dir(), padding_side="right")
    if collator_tok.pad_token is None:
        collator_tok.pad_token = collator_tok.eos_token
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model=model, args=fine_tune_arguments(s, args.run, out),
            train_dataset=Dataset.from_list(study.new_task_samples(tok)),
            eval_dataset=Dataset.from_list(study.new_task_validation_samples(tok)),
            data_collator=DataCollatorForSeq2Seq(collator_tok, padding=True, label_pad_token_id=-100),
            processing_class=tok, callbacks=[finetuned, janus])
        t = time.perf_counter()
        trainer.train()
        total, rectification = time.perf_counter() - t, time.perf_counter() - finetuned.ended
        history = [row for row in trainer.state.log_history if "loss" in row]
    report = janus.report
    scored["finetuned"] = finetuned.figures
    scored["repaired"] = score(janus.model)
    repair = report.repair
    distill_lr = repair.lr if repair else args.distill_lr
    janus_seconds = rectification - (repair.seconds if repair else 0.0)
    record = {
        "run": args.run, "replay": args.replay, "settings": {**vars(args), "distill_lr": distill_lr},
        "train_loss": history,
        "seconds": {"train_call": total, "finetuned_scoring": finetuned.seconds, "rectification": rectification,
                    "janus": janus_seconds, "repair": repair.seconds if repair else None,
                    "fine_tuning": total - finetuned.seconds - rectification},
        "repair_over_janus_time": rectification / janus_seconds if janus_seconds else None,
        # what each distillation step fitted, as the engine batched it (the configuration's new_task_batch_size)
        "new_task_per_step": (int(janus.rectifier.new_task_batches[0]["input_ids"].shape[0])
                              if repair and janus.rectifier.new_task_batches else None),
        **outcome(report, scored),
    }
    log(report.summary())
    if args.quick:
        print(json.dumps(record["seconds"]), record["repair_over_janus_time"])
        return
    atomic_write_text(result_path(args.run, args.tag) + ".json", json.dumps(record, indent=1))
    print(write_markdown())


def outcome(report, scored: dict) -> dict:
    """What every record holds of a rectification and its scoring: the configuration, the run's figures, the repair's
    report, each scored point and the repaired point's share of what fine-tuning lost (logged), and the machine."""
    points = {name: {"past_summary": p["past_summary"], "gsm_nll": p["gsm_nll"]} for name, p in scored.items()}
    points["repaired"].update(
        repair=study.repair_figures(scored["repaired"], scored["theta0"], scored["finetuned"]),
        flips=study.flips(scored["theta0"], scored["finetuned"], scored["repaired"]))
    log(f"[repaired] {points['repaired']['repair']}")
    return {"config": report.config, "jacobian_evaluations": report.num_jacobian_evals,
            "stop_reason": report.stop_reason, "repair": None if report.repair is None else report.repair.to_dict(),
            "points": points,
            "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "platform": platform.platform(), "torch": torch.__version__}}


def merge_repair(args, score, scored: dict, validation: list) -> None:
    """``--merge DIR``: the LoRA adapter ``--save-finetuned`` saved, repaired by ``hf-janus merge`` (the console script
    a user runs, in its own process) with the replay (with ``--replay self``, ``--replay-self 100``: θ0 answers the
    generic prompts, as ``SelfReplay()``) and the new task's samples as JSONL files and the callback's
    settings but the learning rate (the merger's default unless ``--distill-lr``: for a plain LoRA it trains the
    adapter's own factors, as the callback does) and ``--adapter-rank``; the output adapter scored as the callback's
    point is. The merger holds out every eighth new-task sample for the gain, or with ``--merge-validation`` measures
    it on ``validation``, the 16 problems the callback's Trainer had as ``eval_dataset`` (``--new-task-validation``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_janus import load_report

    base_dir, source = os.fspath(smollm2.smollm2_dir()), args.merge

    if args.run == "qlora" and not args.double_quant:
        raise SystemExit("--merge of a QLoRA adapter needs --double-quant: hf-janus merge --load-in-4bit loads the "
                         "base with double quantization")
    quant = {"quantization_config": nf4_config(True)} if args.run == "qlora" else {}

    def adapted(adapter_dir: str):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, **quant)
        return PeftModel.from_pretrained(base, adapter_dir).eval()

    scored["finetuned"] = score(adapted(source))
    script = os.path.join(os.path.dirname(sys.executable), "hf-janus")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "repaired")
        command = [script, "merge", "--base", base_dir, "--adapter", source, "--device", "cpu", "--dtype", "float32",
                   *(["--replay-self", "100"] if args.replay == "self"  # the generic prompts, as SelfReplay()
                     else ["--replay", os.path.join(source, "replay.jsonl"), "--replay-samples", "0"]),
                   "--new-task-samples", os.path.join(source, "new_task.jsonl"),
                   "--compression-rank", str(args.compression_rank), "--distill-steps", str(args.distill_steps),
                   "--adapter-rank", args.adapter_rank, "--format", "adapter", "--output", out, "--no-progress",
                   *(["--load-in-4bit"] if args.run == "qlora" else [])]
        if args.distill_lr:
            command += ["--distill-lr", f"{args.distill_lr:g}"]
        if args.merge_validation:
            path = os.path.join(tmp, "validation.jsonl")
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in validation))
            command += ["--new-task-validation", path]
        log("$ " + " ".join(command))
        t = time.perf_counter()
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
        call = time.perf_counter() - t
        report = load_report(out).rectification
        scored["repaired"] = score(adapted(out))
    repair = report.repair
    total = report.timings.get("total", 0.0)
    # the merger's adapter repair runs after the rectification's clock stops; a repair inside it is a phase of it
    janus = total - report.timings.get("repair", 0.0)
    whole = janus + (repair.seconds if repair else 0.0)
    record = {
        "run": args.run if args.run == "qlora" else "lora", "entry": "hf-janus merge", "replay": args.replay,
        "adapter_rank": args.adapter_rank,
        "settings": {**vars(args), "distill_lr": repair.lr if repair else args.distill_lr},
        "seconds": {"merge_call": call, "janus": janus, "repair": repair.seconds if repair else None,
                    "fine_tuning": None},
        "repair_over_janus_time": whole / janus if janus else None,
        "new_task_per_step": report.config.get("new_task_batch_size"),
        **outcome(report, scored),
    }
    atomic_write_text(result_path(record["run"], args.tag or "merge") + ".json", json.dumps(record, indent=1))
    print(write_markdown())


def replay_label(rec: dict) -> str:
    """The replay column: whose answers, and how many when not the default."""
    size = rec["settings"].get("replay_size")
    if rec["replay"] == "answers":
        return "θ0 answers" + (f" (m={size})" if size not in (None, bench.Settings.n_replay) else "")
    return "SelfReplay()" if size is None else f"SelfReplay(num_samples={size})"


def result_path(run: str, tag: str = "") -> str:
    return os.path.join(RESULTS, f"trainer_repair_{run}{'_' + tag if tag else ''}")


def write_markdown() -> str:
    """One table over every ``trainer_repair_*.json``: the point the callback chose and what it gives back."""
    rows, notes = [], []
    for name in sorted(os.listdir(RESULTS)):
        if not (name.startswith("trainer_repair_") and name.endswith(".json")):
            continue
        with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
            rec = json.load(fh)
        if rec.get("note"):
            notes.append(f"- `{name}`: {rec['note']}")
        fig = rec["points"]["repaired"]["repair"]
        sec = rec["seconds"]
        repair = rec.get("repair") or {}
        fine_tuning = "" if sec["fine_tuning"] is None else f"{sec['fine_tuning']:.0f}"
        rows.append(
            f"| {rec.get('entry', 'JanusCallback')}"
            f"{' --adapter-rank ' + rec['adapter_rank'] if rec.get('adapter_rank') else ''} | {rec['run']} | "
            f"{replay_label(rec)} | "
            f"{rec['config']['distill_steps']} | {rec['settings']['distill_lr']:g} "
            f"{rec['config'].get('distill_schedule', 'constant')} | "
            # before distill_replay_batch_size existed a step took one of JANUS's replay batches
            f"{rec['config'].get('distill_replay_batch_size', rec['config']['replay_batch_size'])} | "
            f"{rec.get('new_task_per_step', rec['config']['new_task_batch_size'])} | {repair.get('chosen')} | "
            f"{fig['ap2']:.1f} | {fig['nq_held_out']['em_back']:.1f} | {fig['webq_held_out']['em_back']:.1f} | "
            f"{fig['nq']['em_back']:.1f} | {fig['webq']['em_back']:.1f} | {fine_tuning} | "
            f"{sec['janus']:.0f} | {sec['repair'] or 0:.0f} | {rec['repair_over_janus_time']:.2f} |")
    text = "\n".join([
        "# The repair through `JanusCallback` in a `Trainer` (SmolLM2-135M-Instruct, GSM8K fine-tune)",
        "",
        "Written by `python -m benchmarks.forgetting.trainer_repair --summarize`; see the script's docstring for the "
        "setting. EM back: the share of θ0's answers θ̂ lost (greedy, token for token) that the repaired model gives "
        "back, on NQ-open and WebQuestions questions never replayed nor used by the callback to choose its point "
        "(held out: the sets `real_study --held-out` reports; scored: its validation sets, which this run never "
        "chose on). AP2: the share of θ̂'s GSM8K test-NLL drop kept. Seconds on the machine in each JSON; "
        "×JANUS: the whole rectification (JANUS + distillation + choice) over JANUS alone.",
        "",
        "| entry | run | replay | distill steps | lr, schedule | replay samples a step | new-task samples a step | "
        "chosen | AP2 | NQ held-out EM back | WebQ held-out EM back | NQ EM back | WebQ EM back | fine-tune s | "
        "JANUS s | repair s | ×JANUS |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows, "", *notes])
    path = os.path.join(RESULTS, "trainer_repair.md")
    atomic_write_text(path, text)
    return text


if __name__ == "__main__":
    main()
