"""What lifts JANUS's repair on the real model, and why the likelihood repair does not become an exact-match repair
(issue 43 item 2): one fine-tuned SmolLM2-135M-Instruct, several JANUS settings, the past behaviour scored three
ways.

    python -m benchmarks.forgetting.real_study --run full --variants base,wise,selfgen,token,m128 --threads 2
    python -m benchmarks.forgetting.real_study --run full --margins   # θ0's answer margins (after a run)
    python -m benchmarks.forgetting.real_study --run full --summarize

The fine-tuning is ``real_model.py``'s (same data, steps and learning rate; ``full``: float32 full fine-tuning,
``lora``: LoRA r=16 on the bf16 model), done once and kept with θ0's answers in ``cache/real_study/<run>``; each
variant then rectifies a fresh copy of θ̂ through the public ``rectify``.

* **Past behaviour**: θ0's greedy answers (token ids, batched generation, cut after the first token holding a
  newline, as the QA task cuts them) to NQ-open questions never replayed and to WebQuestions questions. Scored
  teacher-forced, one forward pass per batch:
  - *answer NLL*: mean per-token NLL of θ0's answer tokens (what JANUS protects to first order);
  - *token EM*: the share of answers whose every token is the model's argmax given θ0's own prefix, which is
    exactly "greedy decoding reproduces θ0's answer token for token" (stricter than lm-eval's normalized EM);
  - *flips*: where a lost answer first differs, and θ0's margin (chosen token minus runner-up) on each answer.
  Repair figures are shares of what fine-tuning lost: NLL rise undone = (NLL_θ̂ − NLL)/(NLL_θ̂ − NLL_θ0), EM back =
  (EM − EM_θ̂)/(EM_θ0 − EM_θ̂).
* **New task**: GSM8K worked answers' per-token NLL on test problems; AP2 = share of θ̂'s NLL reduction kept.
* **Variants** (``--variants``, comma-separated): each is ``+``-joined levers (see :func:`levers`), for example
  ``base`` (the defaults: 64 replayed answers, loss on the answer), ``m128`` (128 answers), ``tokenloss2``
  (``constraint="token_loss"``, 2 tokens), ``tokenloss2+m128+r16`` (both, at compression rank 16), ``token`` (each
  of the first 3 tokens of each answer its own sample), ``whole`` (loss on the whole sequence, prompt included),
  ``selfgen`` (data-free: hf_janus's ``SelfReplay`` from its generic prompts), ``tau99``, ``steps20``,
  ``logitproj``; ``corda`` and ``osf`` (issue 40's training-time peers, trained like the LoRA: PEFT's CorDA-KPM LoRA
  and OSF), ``corda+janus`` (JANUS on top of the CorDA adapter); and ``wise`` (WiSE-FT a = 0.25, 0.5, 0.75, 0.9:
  the curve the margins are read against). The
  first 64 replayed answers are scored too (``replayed``): what stays lost there is not for want of replay.
  Results: ``results/real_study_<run>.{json,md}``.
* **Held-out questions** (``--held-out``): every choice so far (levers, grids, b) was read off the scored questions
  above, which makes them validation questions. This flag also scores NQ-open and WebQuestions questions no session
  has scored or replayed (:data:`HELD_OUT_NQ`, :data:`HELD_OUT_WQ`), picks each run's point by :func:`chosen_point`
  on the validation questions alone, and reports the held-out figures of that point; results go to
  ``results/real_study_<run>_held_out.{json,md}`` (a fresh record: WiSE-FT must be among the variants).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Iterator, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
from benchmarks import smollm2  # noqa: E402  (the offline SmolLM2 folder)
from benchmarks.memory_probe import own_peak_bytes  # noqa: E402
from benchmarks.forgetting import lib  # noqa: E402
from benchmarks.forgetting import real_model as bench  # noqa: E402
from benchmarks.forgetting.variants import above_wise  # noqa: E402

from hf_janus import JanusConfig, SelfReplay, rectify  # noqa: E402
from hf_janus.engine.constraints import (  # noqa: E402
    Constraint,
    ReplayLogits,
    TokenLossConstraint,
    constraint_names,
    register,
)
from hf_janus.evaluation.candidates.base import interpolate  # noqa: E402
from hf_janus.io_utils import atomic_write_text  # noqa: E402
from hf_janus.evaluation.local_tasks import qa_prompt  # noqa: E402

log = bench.log
# the model's dtype per run; QLoRA's is its compute dtype (the base stays nf4 while it trains)
DTYPES = {"full": torch.float32, "lora": torch.bfloat16, "qlora": torch.bfloat16}
POOL_QUESTIONS = 150  # NQ-open questions θ0 answers for the replay (those with a word in the answer are kept)
TOKEN_ROWS = 3  # answer tokens per replayed answer, each its own row (lost answers flip early: see flips)
WISE_GRID = (0.25, 0.5, 0.75, 0.9)
PEERS = ("corda", "osf")  # training-time peers (issue 40): a variant naming one starts from its θ̂ instead
# multi-row constraints keep k + 1 rows of factors per sample: beyond the memory plan's share they spill here
FACTOR_CACHE = os.path.join(tempfile.gettempdir(), "janus-real-study-factors")
# questions in the study's shuffled order that no session scored or replayed; the replay pool's extension stops
# before HELD_OUT_NQ so that no m replays them
HELD_OUT_NQ = slice(608, 768)
HELD_OUT_WQ = slice(90, 256)
HELD_OUT_MAX = 128  # answers kept per held-out set
CHOICE_MIN_AP2 = 95.0  # the frontier's --min-ap2 95, as every session chose
LINEAR_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # "all-linear" here


# ---- θ0's answers as token ids ----------------------------------------------------------------------------------
def own_answers(model, tok, questions: list[str], max_new_tokens: int, batch: int = 16) -> list[dict]:
    """θ0's greedy answer ids to each question, as the product's :class:`SelfReplay` answers completion-style prompts
    (batched, left-padded, cut after the token that completes the first newline); answers with no word character
    are left out (nothing to keep)."""
    prompts = [qa_prompt({"question": q}) for q in questions]
    samples = SelfReplay(prompts=prompts, num_samples=None, chat_template=False, stop=["\n"],
                         max_new_tokens=max_new_tokens, batch_size=batch, cache_dir=False,
                         progress=False).generate(model, tok)
    out = []
    for q, sample in zip(questions, samples):
        n = sample["labels"].count(-100)  # the prompt's labels; an answer token never is -100
        prompt, cut = sample["input_ids"][:n], sample["input_ids"][n:]
        text = tok.decode(cut, skip_special_tokens=True).split("\n")[0]
        if any(c.isalnum() for c in text):
            out.append({"question": q, "prompt_ids": prompt, "answer_ids": cut, "answer": text.strip()})
    return out


def replay_samples(rows: list[dict], mode: str = "answer", max_tokens: Optional[int] = None) -> list[dict]:
    """Replay samples from θ0's answers: loss on the answer (``answer``), on every token (``whole``), or one sample
    per answer token, each with that token's loss alone (``token``; the first ``max_tokens`` of each answer)."""
    out = []
    for r in rows:
        ids = r["prompt_ids"] + r["answer_ids"]
        n = len(r["prompt_ids"])
        if mode == "whole":
            out.append({"input_ids": ids, "labels": list(ids)})
        elif mode == "token":
            for k in range(min(len(r["answer_ids"]), max_tokens or len(r["answer_ids"]))):
                labels = [-100] * len(ids)
                labels[n + k] = ids[n + k]
                out.append({"input_ids": ids[: n + k + 1], "labels": labels[: n + k + 1]})
        else:
            out.append({"input_ids": ids, "labels": [-100] * n + r["answer_ids"]})
    return out


# ---- scoring --------------------------------------------------------------------------------------------------
def _batches(rows, size):
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


@torch.no_grad()
def score_answers(model, rows: list[dict], pad: int, batch: int = 16) -> dict:
    """Teacher-forced on θ0's answer ids: per answer its NLL sum, token count, argmax hits and first miss."""
    nll, count, exact, first_miss, hits = [], [], [], [], []
    for chunk in _batches(rows, batch):
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, -1)
        for i, r in enumerate(chunk):
            n, a = len(r["prompt_ids"]), torch.tensor(r["answer_ids"])
            pos = torch.arange(n - 1, n - 1 + len(a))
            lp = logp[i, pos].gather(1, a[:, None])[:, 0]
            ok = logits[i, pos].argmax(-1) == a
            nll.append(float(-lp.sum()))
            count.append(len(a))
            hits.append(ok.tolist())
            exact.append(bool(ok.all()))
            first_miss.append(None if ok.all() else int((~ok).nonzero()[0]))
    return {"nll": nll, "tokens": count, "exact": exact, "first_miss": first_miss, "hits": hits}


@torch.no_grad()
def gsm_nll(model, tok, rows: list[tuple[str, str]], batch: int = 8) -> float:
    """Mean per-token NLL of the worked answers given the question (the new task)."""
    total, n = 0.0, 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for chunk in _batches(rows, batch):
        pairs = [(tok(p)["input_ids"], tok(a)["input_ids"] + [tok.eos_token_id]) for p, a in chunk]
        seqs = [p + a for p, a in pairs]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        labels = torch.tensor([[-100] * len(p) + a + [-100] * (width - len(p) - len(a)) for p, a in pairs])
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        k = int((labels[:, 1:] != -100).sum())
        total += float(out.loss) * k
        n += k
    return total / n


@torch.no_grad()
def answer_margins(model, rows: list[dict], pad: int, batch: int = 16) -> list[float]:
    """Per answer, θ0's smallest log-probability gap between its chosen token and the runner-up over the answer's
    tokens: how far the greedy answer is from flipping."""
    out = []
    for chunk in _batches(rows, batch):
        seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        for i, r in enumerate(chunk):
            n = len(r["prompt_ids"])
            top2 = logp[i, n - 1:n - 1 + len(r["answer_ids"])].topk(2, -1).values
            out.append(float((top2[:, 0] - top2[:, 1]).min()))
    return out


def margin_table(theta0, finetuned, data: dict, pad: int) -> dict:
    """θ0's answers binned by their smallest margin: how many, and how many θ̂ still reproduces."""
    sets = {"nq": data["eval_nq"], "webq": data["eval_wq"]}
    bins = [(0.0, 0.5), (0.5, 1.0), (1.0, 2.0), (2.0, float("inf"))]
    out = {}
    for name, rows in sets.items():
        margins = answer_margins(theta0, rows, pad)
        kept = score_answers(finetuned, rows, pad)["exact"]
        out[name] = [{"margin": f"[{lo:g}, {hi:g})", "answers": sum(lo <= m < hi for m in margins),
                      "kept_by_finetuned": sum(lo <= m < hi and k for m, k in zip(margins, kept))}
                     for lo, hi in bins]
        out[name + "_median_margin"] = float(torch.tensor(margins).median())
    return out


def summary(scored: dict) -> dict:
    """Per set: mean answer NLL per token, token EM (%), per-token argmax agreement (%), first-token agreement (%)."""
    tokens = sum(scored["tokens"])
    return {"nll": sum(scored["nll"]) / tokens, "em": 100 * sum(scored["exact"]) / len(scored["exact"]),
            "token_acc": 100 * sum(sum(h) for h in scored["hits"]) / tokens,
            "first_token_acc": 100 * sum(h[0] for h in scored["hits"]) / len(scored["hits"])}


def evaluate(model, tok, sets: dict, gsm: list, pad: int) -> dict:
    model.eval()
    out = {name: score_answers(model, rows, pad) for name, rows in sets.items()}
    return {"past": out, "past_summary": {k: summary(v) for k, v in out.items()}, "gsm_nll": gsm_nll(model, tok, gsm)}


def repair_figures(point: dict, theta0: dict, ft: dict) -> dict:
    """Shares of what fine-tuning lost that ``point`` gives back, per past set, and AP2."""
    out = {}
    for name, s in point["past_summary"].items():
        s0, s1 = theta0["past_summary"][name], ft["past_summary"][name]
        rise = s1["nll"] - s0["nll"]
        lost = s0["em"] - s1["em"]
        out[name] = {"nll_undone": 100 * (s1["nll"] - s["nll"]) / rise if rise else None,
                     "em_back": 100 * (s["em"] - s1["em"]) / lost if lost else None,
                     "ap1_em": 100 * s["em"] / s0["em"] if s0["em"] else None}
    gain = theta0["gsm_nll"] - ft["gsm_nll"]
    out["ap2"] = 100 * (theta0["gsm_nll"] - point["gsm_nll"]) / gain if gain else None
    return out


def flips(theta0: dict, ft: dict, point: dict) -> dict:
    """Of the answers θ0 reproduces and θ̂ loses: where θ̂ first misses, and how many the point gets back."""
    out = {}
    for name in point["past"]:
        a0, a1, ap = theta0["past"][name], ft["past"][name], point["past"][name]
        lost = [i for i in range(len(a0["exact"])) if a0["exact"][i] and not a1["exact"][i]]
        first = sum(1 for i in lost if a1["first_miss"][i] == 0)
        back = [i for i in lost if ap["exact"][i]]
        back_first = sum(1 for i in lost if a1["first_miss"][i] == 0 and ap["exact"][i])
        out[name] = {"lost": len(lost), "lost_at_first_token": first, "back": len(back),
                     "back_of_those_lost_at_first_token": back_first,
                     "newly_lost": sum(1 for i in range(len(a0["exact"])) if a0["exact"][i] and a1["exact"][i]
                                       and not ap["exact"][i])}
    return out


# ---- the fine-tuned model -------------------------------------------------------------------------------------
def prepare(args, s, tok, work: str):
    """θ0, θ̂'s weights of the target layers (exact: float32 θ0 + ΔW of the LoRA; the full fine-tune's own) and θ0's
    answers; each cached in ``work`` as soon as it exists."""
    from transformers import AutoModelForCausalLM

    base_dir = os.fspath(smollm2.smollm2_dir())
    dtype = DTYPES[args.run]
    data_path = os.path.join(work, "data.json")
    delta_path = os.path.join(work, "finetuned_exact.pt")
    quantized = None
    if args.run == "qlora":
        # θ0 is the base as a QLoRA user has it: the nf4 weights dequantized, saved once as a plain folder
        from transformers import BitsAndBytesConfig

        reference = os.path.join(work, "base-nf4-dequantized")
        if not os.path.isfile(delta_path):
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
            quantized = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant, dtype=dtype)
            if not os.path.isdir(reference):
                bench.dequantized_base(quantized, reference, dtype)
        base_dir = reference
    theta0 = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    os.makedirs(work, exist_ok=True)
    if os.path.isfile(data_path):
        with open(data_path, encoding="utf-8") as fh:
            data = json.load(fh)
    else:
        data = own_behaviour(s, tok, theta0)
        atomic_write_text(data_path, json.dumps(data))
    if os.path.isfile(delta_path):
        return theta0, {name: w.detach() for name, w in torch.load(delta_path).items()}, data
    train = fine_tuning_samples()
    if args.run == "full":
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        data["fine_tuning"] = bench.fine_tune(s, args.run, model, tok, train)
        before = dict(theta0.named_parameters())
        exact = {name: p.detach().float().clone() for name, p in model.named_parameters()
                 if not torch.equal(p, before[name])}  # every parameter the fine-tune changed
    else:
        from peft import get_peft_model

        base = quantized if quantized is not None else AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
        model = get_peft_model(base, bench.lora_config(s))
        data["fine_tuning"] = bench.fine_tune(s, args.run, model, tok, train)
        exact = adapter_weights(model, theta0, quantized is not None)
    torch.save(exact, delta_path)
    atomic_write_text(data_path, json.dumps(data))
    return theta0, exact, data


def adapter_weights(model, theta0, quantized: bool = False) -> dict:
    """θ̂'s weights of every adapted layer of a PEFT model, in float32: the base layer's weight plus PEFT's own
    ``get_delta_weight`` (LoRA, CorDA's residual base, OSF); a quantized base reads θ0's dequantized weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    exact = {}
    with torch.no_grad():  # θ̂'s weights, not a graph
        for name, module in model.named_modules():
            if isinstance(module, BaseTunerLayer) and "default" in module.active_adapters:
                key = name.replace("base_model.model.", "") + ".weight"
                w0 = theta0.get_parameter(key) if quantized else module.get_base_layer().weight
                exact[key] = w0.float() + module.get_delta_weight("default").float()
    return exact


def peer_weights(kind: str, args, s, tok, theta0, data: dict, work: str, lr: Optional[float] = None) -> dict:
    """A training-time peer's θ̂ (issue 40), trained with the LoRA run's data and steps from θ0 and cached in
    ``work``: ``corda`` is a CorDA-KPM LoRA r=16 (PEFT's ``preprocess_corda``; the covariance from the 64 replayed
    answers, the knowledge it keeps), ``osf`` an OSF model training the bottom 16 singular directions of each
    layer (PEFT's ``OSFConfig``) at the full fine-tune's learning rate; ``lr`` replaces the learning rate."""
    from dataclasses import replace

    from peft import get_peft_model

    name = kind if lr is None else f"{kind}_lr{lr:g}"
    path = os.path.join(work, f"{name}_exact.pt")
    if os.path.isfile(path):
        return {name: w.detach() for name, w in torch.load(path).items()}
    model = copy.deepcopy(theta0).train()
    if kind == "corda":
        from peft.tuners.lora.config import CordaConfig
        from peft.tuners.lora.corda import preprocess_corda

        # preprocess_corda does not expand "all-linear": the LoRA's layers by name
        config = replace(bench.lora_config(s), init_lora_weights="corda", target_modules=LINEAR_NAMES,
                         corda_config=CordaConfig(corda_method="kpm"))

        def run_model():  # one unpadded sequence per call: PEFT's covariance hook reads a batch of one
            for r in data["pool"][:64]:
                model(input_ids=torch.tensor([r["prompt_ids"] + r["answer_ids"]]))

        t = time.perf_counter()
        preprocess_corda(model, config, run_model=run_model)
        data[f"{name}_preprocess_seconds"] = time.perf_counter() - t
        lr = s.lr["lora"] if lr is None else lr
    elif kind == "osf":
        from peft import OSFConfig

        # trainable rank 16 in every layer, as the LoRA's: the rest of the spectrum frozen
        ranks = {re.escape(name) + "$": min(m.weight.shape) - s.lora_r for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head"}
        config = OSFConfig(target_modules="all-linear", rank_pattern=ranks, task_type="CAUSAL_LM")
        lr = s.lr["full"] if lr is None else lr
    else:
        raise SystemExit(f"unknown training-time peer {kind!r}: corda or osf")
    model = get_peft_model(model, config)
    train = fine_tuning_samples()
    data[f"{name}_fine_tuning"] = {**bench.fine_tune(replace(s, lr={**s.lr, kind: lr}), kind, model, tok, train),
                                   "lr": lr}
    exact = adapter_weights(model, theta0)
    torch.save(exact, path)
    return exact


def posthoc_points(spec: str, theta0, exact: dict, replay: list[dict], tok) -> list[tuple[str, object, dict]]:
    """Issue 40's post-hoc peers on this run: each candidate of ``spec`` (``hf-janus frontier --candidates``
    syntax, for example ``"replay-sft:passes=4,8 input-null regmean fisher lines"``) built by the frontier's own
    weight builder from θ0, θ̂, the replay and, for a ``new_task_weight``, the fine-tuning's samples; yields
    ``(label, model holding it, cost)`` one at a time."""
    from hf_janus.engine.layers import resolve_target_modules
    from hf_janus.evaluation.candidate_weights import WeightBuilder
    from hf_janus.evaluation.candidates import BuildContext, parse_candidates

    config = JanusConfig()
    model = finetuned_model(theta0, exact)
    start = {k: theta0.get_parameter(k).detach().float() for k in exact}
    cands = parse_candidates(spec)
    fitted = any(getattr(c, "new_task_weight", None) is not None for c in cands)
    builder = WeightBuilder(model, start, {k: w.float() for k, w in exact.items()}, tok, None, replay,
                            new_task=new_task_samples(tok) if fitted else None)
    builder.target_layers = frozenset(resolve_target_modules(model, config.target_modules, config.exclude_modules))
    context = BuildContext(config=config, rectify_fn=rectify)
    for candidate in cands:
        candidate.check(builder)
        peak, cost = own_peak_bytes(lambda: candidate.prepare(builder, context))
        builder.write(builder.weights(candidate))
        yield candidate.label, model, {**asdict(cost), "peak_host_bytes": peak}


def solution(row: dict) -> str:
    """The worked answer without its calculator annotations, as run.py trains it."""
    return lib.Math(row["question"], row["answer"]).target[1:]


def shuffled_questions(s) -> tuple[list[str], list[str]]:
    """The NQ-open and WebQuestions questions in the study's order (one generator shuffles both, NQ-open first): the
    scored questions, the replay pool, its extension and the held-out questions all index these two orders."""
    rng = random.Random(s.seed)
    nq = lib.read_jsonl("nq_open_dev_subset.jsonl")
    rng.shuffle(nq)
    wq = lib.read_jsonl("webquestions_val_subset.jsonl")
    rng.shuffle(wq)
    key = "qText" if "qText" in wq[0] else "question"
    return [r["question"] for r in nq], [r[key] for r in wq]


def own_behaviour(s, tok, theta0) -> dict:
    """θ0's answers: the replay pool (other NQ-open questions), the scored NQ-open and WebQuestions questions; and
    the new task's test problems."""
    nq, wq = shuffled_questions(s)
    t = time.perf_counter()
    eval_nq = own_answers(theta0, tok, nq[:130], s.answer_tokens)[: s.n_nq_eval]
    pool = own_answers(theta0, tok, nq[160:160 + POOL_QUESTIONS], s.answer_tokens)
    eval_wq = own_answers(theta0, tok, wq[:90], s.answer_tokens)[: s.n_wq_eval]
    generation_s = time.perf_counter() - t
    log(f"[data] θ0's answers: {len(pool)} replay pool, {len(eval_nq)} + {len(eval_wq)} scored, "
        f"{generation_s:.0f}s")
    gsm = [(bench.MATH_PROMPT.format(question=r["question"]), " " + solution(r))
           for r in lib.read_jsonl("gsm8k_test_subset.jsonl")[: s.n_gsm_test]]
    return {"pool": pool, "eval_nq": eval_nq, "eval_wq": eval_wq, "gsm": gsm, "generation_seconds": generation_s,
            "generated_answers": 130 + POOL_QUESTIONS + 90}


def held_out_sets(s, tok, theta0, data: dict, save) -> dict:
    """θ0's answers to the held-out questions (generated once, kept in ``data``): at most :data:`HELD_OUT_MAX` per
    set, from NQ-open questions past any replay pool and WebQuestions questions past the scored ones."""
    if "held_out_nq" not in data:
        nq, wq = shuffled_questions(s)
        t = time.perf_counter()
        data["held_out_nq"] = own_answers(theta0, tok, nq[HELD_OUT_NQ], s.answer_tokens)[:HELD_OUT_MAX]
        data["held_out_wq"] = own_answers(theta0, tok, wq[HELD_OUT_WQ], s.answer_tokens)[:HELD_OUT_MAX]
        data["held_out_generation_seconds"] = time.perf_counter() - t
        save()
    log(f"[data] held out: {len(data['held_out_nq'])} NQ-open + {len(data['held_out_wq'])} WebQuestions answers")
    return {"nq_held_out": data["held_out_nq"], "webq_held_out": data["held_out_wq"]}


def chosen_point(points: dict, min_ap2: float = CHOICE_MIN_AP2) -> Optional[str]:
    """The point the study recommends, chosen on the validation questions alone: of the settings' points (not θ0,
    θ̂ or WiSE-FT) with AP2 ≥ ``min_ap2``, the one that gives back the most of the lost exact matches (EM back, NQ-open
    and WebQuestions averaged; the larger AP2 breaks ties); None when no point keeps that much of the gain."""
    pool = [(name, p["repair"]) for name, p in points.items() if not name.startswith("wise")
            and (p.get("repair") or {}).get("ap2") is not None and p["repair"]["ap2"] >= min_ap2]
    if not pool:
        return None
    return max(pool, key=lambda item: ((item[1]["nq"]["em_back"] + item[1]["webq"]["em_back"]) / 2,
                                       item[1]["ap2"]))[0]


def finetuned_model(theta0, exact: dict):
    """θ0 with the parameters in ``exact`` replaced (rounded to the model's dtype)."""
    model = copy.deepcopy(theta0)
    with torch.no_grad():
        for name, w in exact.items():
            model.get_parameter(name).copy_(w.to(model.dtype))
    return model


def levers(name: str) -> dict:
    """A variant's levers: ``+``-joined parts, each one of ``m<N>`` (replayed answers), ``r<N>`` (compression rank),
    ``tau<NN>`` (τ = 0.NN), ``steps<N>`` (``max_steps``), ``tokenloss[k]`` (the ``token_loss`` constraint, k tokens),
    ``token`` (one sample per early answer token), ``whole``, ``selfgen``, ``logitproj``, ``targetlogit``,
    ``marginonly[k]`` / ``margin[k]`` (:class:`TokenMargin` without / with the token losses), ``damp<N>``
    (``damping`` = 0.N); ``ref<N>`` and ``hat<N>`` (repeatable) also score the frontier's hybrids of the JANUS
    point, JANUS → θ0 (θ0 + b(θ_J − θ0)) and JANUS → θ̂ (θ_J + b(θ̂ − θ_J)), at b = 0.N; ``fromhat+kl<N>``
    (repeatable) scores θ̂ trained for N passes on the replay's KL to θ0 without JANUS (the frontier's
    ``replay-sft``; ``kllr<X>e-<Y>`` its learning rate), and ``kref<N>`` / ``khat<N>`` that point's hybrids;
    ``anchor<N>`` makes each step of that training also fit N of the fine-tuning's own samples (the candidate's
    ``new_task_weight=1``); ``base`` and ``janus`` are the defaults; ``corda``/``osf`` start from that
    training-time peer's θ̂ (alone: the peer, not rectified), and ``lr<X>e-<Y>`` sets the peer's learning rate;
    ``repair<N>`` is the product's own repair after JANUS (``JanusConfig.distill_steps=N``, through ``rectify``'s
    ``new_task``: the fine-tuning's own samples), which chooses its point itself (``kllr`` its ``distill_lr``,
    ``anchor<N>`` its ``new_task_batch_size``, ``ntw<X>`` its ``new_task_weight``, ``keep<NN>`` its ``keep_gain`` =
    0.NN; ``val`` measures its gain on 16 GSM8K problems the fine-tune never saw, as a Trainer's ``eval_dataset``,
    instead of a slice of its own)."""
    out: dict = {"m": 64}
    for part in name.split("+"):
        number = re.fullmatch(r"(m|r|tau|steps|tokenloss|margin|marginonly)(\d*)", part)
        fraction = re.fullmatch(r"(damp|ref|hat|kref|khat)(\d+)", part)
        then = re.fullmatch(r"kl(\d+)", part)
        anchored = re.fullmatch(r"anchor(\d+)", part)
        repaired = re.fullmatch(r"(repair|keep)(\d+)", part)
        weighted = re.fullmatch(r"ntw(\d+(?:\.\d+)?)", part)
        rate = re.fullmatch(r"(kl)?lr(\d+(?:\.\d+)?e-\d+)", part)
        if rate:
            out[(rate.group(1) or "") + "lr"] = float(rate.group(2))
        elif weighted:
            out["ntw"] = float(weighted.group(1))
        elif repaired:
            value = int(repaired.group(2))
            out[repaired.group(1)] = value if repaired.group(1) == "repair" else value / 10 ** len(repaired.group(2))
        elif anchored:  # the replay training also fits N fine-tuning samples per step
            out["anchor"] = int(anchored.group(1))
        elif then:  # replay training after the JANUS point, scored beside it
            out.setdefault("kl", []).append(int(then.group(1)))
        elif fraction:
            value = int(fraction.group(2)) / 10 ** len(fraction.group(2))
            if fraction.group(1) == "damp":
                out["damp"] = value
            else:  # the frontier's hybrids, scored after the JANUS (or replay-trained) point: several b per variant
                out.setdefault(fraction.group(1), []).append(value)
        elif part in ("base", "janus", "token", "whole", "selfgen", "logitproj", "targetlogit", "fromhat",
                      "val") + PEERS:
            out[part] = True
        elif number and number.group(1) in ("tokenloss", "margin", "marginonly"):
            out[number.group(1)] = int(number.group(2) or TOKEN_ROWS)
        elif number and number.group(2):
            key, value = number.group(1), int(number.group(2))
            out[key] = value / 10 ** len(number.group(2)) if key == "tau" else value
        else:
            raise SystemExit(f"unknown lever {part!r} in variant {name!r}: see the docstring of levers()")
    if "kl" in out and not out.get("fromhat"):
        raise SystemExit(f"variant {name!r}: kl<N> after the JANUS point was the frontier's janus-then-replay-sft, "
                         "now the product's repair after JANUS: use repair<N> (the runs recorded with it: "
                         "git show f0a64fc:benchmarks/forgetting/real_study.py); kl<N> with fromhat is the "
                         "distillation alone")
    if out.get("fromhat") and ("ref" in out or "hat" in out):
        raise SystemExit(f"variant {name!r}: fromhat makes no JANUS point for ref/hat to mix; use kref/khat")
    return out


def pool_extension(nq: list, start: int, size: int = 64) -> Iterator[tuple[int, list]]:
    """Chunks of ``size`` questions of the study's NQ-open order from ``start`` on, each with the index past it, for
    the replay pool to grow into; they stop before the held-out questions, so that no replay size reaches them."""
    while start < HELD_OUT_NQ.start:
        chunk = nq[start:min(start + size, HELD_OUT_NQ.start)]
        start += len(chunk)
        yield start, chunk


def replay_pool(s, data: dict, m: int, tok, theta0, save) -> list[dict]:
    """The first ``m`` of θ0's answers to NQ-open questions outside the scored ones; more are generated (and cached
    in ``data``) from the rest of the NQ-open subset (:func:`pool_extension`) when the pool is short."""
    pool = data["pool"]
    if m > len(pool):
        nq, _ = shuffled_questions(s)
        for end, chunk in pool_extension(nq, 160 + data.get("pool_questions", POOL_QUESTIONS)):
            if len(pool) >= m:
                break
            t = time.perf_counter()
            pool.extend(own_answers(theta0, tok, chunk, s.answer_tokens))
            data["generation_seconds"] += time.perf_counter() - t
            data["pool_questions"] = end - 160
            save()
        if len(pool) < m:
            raise SystemExit(f"only {len(pool)} replayable answers in the NQ-open subset, {m} asked")
    return pool[:m]


def variant_replay(lever: dict, pool: list[dict], tok, theta0):
    if lever.get("selfgen"):
        return SelfReplay(num_samples=lever["m"], progress=False, max_new_tokens=24).generate(theta0, tok)
    if lever.get("token"):
        return replay_samples(pool, "token", TOKEN_ROWS)
    return replay_samples(pool, "whole" if lever.get("whole") else "answer")


class TokenMargin(Constraint):
    """A prototype (issue 43): each of a replayed answer's first k tokens keeps its lead over the runner-up
    (target logit minus the largest other logit) to first order, with its own loss too when ``with_loss``, and the
    rest of the answer's loss is one more row. θ0's answers are near-ties, and a token loss held fixed leaves the
    runner-up free to overtake the target."""

    def __init__(self, tokens: int, with_loss: bool):
        self.tokens, self.with_loss = tokens, with_loss

    @classmethod
    def register(cls, tokens: int, with_loss: bool) -> str:
        name = f"study-token-margin{'-loss' if with_loss else ''}-{tokens}"
        if name not in constraint_names():
            register(type(name, (cls,), {"name": name, "summary": cls.__doc__.splitlines()[0],
                                         "from_config": classmethod(lambda c, _: c(tokens, with_loss))}))
        return name

    @property
    def rows_per_sample(self) -> int:
        return self.tokens * (2 if self.with_loss else 1) + 1

    def functions(self, batch: ReplayLogits) -> torch.Tensor:
        targets = batch.targets.clamp(min=0).unsqueeze(-1)
        picked = batch.scores.gather(-1, targets).squeeze(-1)
        runner_up = batch.scores.scatter(-1, targets, float("-inf")).amax(dim=-1)
        # the margins through the token-loss rows' own selection of each early token, and their rest-of-answer row
        margins = TokenLossConstraint(self.tokens).functions(replace(batch, per_token=picked - runner_up))
        losses = TokenLossConstraint(self.tokens).functions(batch)
        rows = []
        for j in range(self.tokens):
            rows += [margins[:, j], losses[:, j]] if self.with_loss else [margins[:, j]]
        return torch.stack(rows + [losses[:, self.tokens]], dim=1)


def variant_config(lever: dict) -> JanusConfig:
    options = {}
    if "tokenloss" in lever:
        # k + 1 rows per sample: the factors may not fit the host memory, and spill to disk beyond half of it
        options.update(constraint="token_loss", constraint_options={"tokens": lever["tokenloss"]}, cache=FACTOR_CACHE)
    if lever.get("logitproj"):
        options["constraint"] = "logit_projections"
    if lever.get("targetlogit"):
        options["constraint"] = "target_logit"
    for kind in ("margin", "marginonly"):
        if kind in lever:
            options.update(constraint=TokenMargin.register(lever[kind], with_loss=kind == "margin"),
                           cache=FACTOR_CACHE)
    for key, field in (("r", "compression_rank"), ("tau", "tau"), ("steps", "max_steps"), ("damp", "damping"),
                       ("repair", "distill_steps"), ("keep", "keep_gain")):
        if key in lever:
            options[field] = lever[key]
    if "repair" in lever:
        settings = (("kllr", "distill_lr"), ("anchor", "new_task_batch_size"), ("ntw", "new_task_weight"))
        options.update({field: lever[key] for key, field in settings if key in lever})
    return JanusConfig(**options)


def hybrids(name: str, lever: dict, theta0, rectified, finetuned: dict, prefix: str = ""):
    """The frontier's hybrids of a JANUS point the variant asks for (``ref``, ``hat``; with ``prefix="k"`` those of
    its replay-trained point, ``kref``, ``khat``), as (label, weights): no more rectification. ``rectified`` is a
    model holding the point or its weights."""
    point = {k: (rectified[k] if isinstance(rectified, dict) else rectified.get_parameter(k)).detach()
             for k in finetuned}
    origin = {k: theta0.get_parameter(k).detach() for k in finetuned}
    for b in lever.get(prefix + "ref", ()):
        yield f"{name} → θ0 b={b:g}", interpolate(origin, point, b)
    for b in lever.get(prefix + "hat", ()):
        yield f"{name} → θ̂ b={b:g}", interpolate(point, finetuned, b)


def fine_tuning_samples() -> list[tuple[str, str]]:
    """(prompt, answer) pairs of the GSM8K subset the fine-tunes train on."""
    return [(bench.MATH_PROMPT.format(question=r["question"]), " " + solution(r))
            for r in lib.read_jsonl("gsm8k_train_subset.jsonl")]


def new_task_samples(tok) -> list[dict]:
    """The fine-tuning's own samples as labelled token ids, in its order and truncation: what the replay training's
    ``new_task_weight`` fits (taken in this order)."""
    s = bench.Settings()
    s.ft_batch, s.ft_steps = 1, s.ft_steps * s.ft_batch
    return [{"input_ids": b["input_ids"][0].tolist(), "labels": b["labels"][0].tolist()}
            for b in bench.train_batches(s, tok, fine_tuning_samples())]


def new_task_validation_samples(tok, count: int = 16) -> list[dict]:
    """``count`` GSM8K training problems the fine-tune never saw (the next ones in its order), labelled as
    :func:`new_task_samples`: a Trainer's ``eval_dataset``, for the repair's gain."""
    s = bench.Settings()
    seen = s.ft_steps * s.ft_batch
    s.ft_batch, s.ft_steps = 1, seen + count
    return [{"input_ids": b["input_ids"][0].tolist(), "labels": b["labels"][0].tolist()}
            for b in bench.train_batches(s, tok, fine_tuning_samples())][seen:]


def replay_trained(name: str, lever: dict, theta0, finetuned: dict, replay: list[dict], tok,
                   config: JanusConfig):
    """θ̂ trained on the replay's KL to θ0 for each ``kl<N>`` (with ``fromhat``: the distillation alone, without
    JANUS, the frontier's ``replay-sft``); yields (label, weights, its :class:`Cost`)."""
    from hf_janus.evaluation.candidate_weights import WeightBuilder
    from hf_janus.evaluation.candidates import BuildContext, ReplaySft
    from hf_janus.evaluation.candidates.replay_sft import DEFAULT_LR

    origin = {k: theta0.get_parameter(k).detach().float() for k in finetuned}
    finetuned = {k: w.float() for k, w in finetuned.items()}
    context = BuildContext(config=config, rectify_fn=rectify)
    anchor = new_task_samples(tok) if "anchor" in lever else None
    for passes in lever.get("kl", ()):
        builder = WeightBuilder(finetuned_model(theta0, finetuned), origin, finetuned, tok, None, replay,
                                new_task=anchor)
        settings = dict(passes=passes, lr=lever.get("kllr", DEFAULT_LR),
                        **({} if anchor is None else {"new_task_weight": 1.0, "new_task_batch_size": lever["anchor"]}))
        candidate = ReplaySft(loss="kl", **settings)
        cost = candidate.prepare(builder, context)
        rate = f", lr {candidate.lr:g}" if "kllr" in lever else ""
        fitted = "" if anchor is None else f", anchored on {lever['anchor']} fine-tuning samples a step"
        yield f"{name}: θ̂ → replay KL {passes} passes{rate}{fitted}", candidate.weights(builder), cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=tuple(DTYPES), default="full")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="the model's dtype (default: the run's; bf16 is slow on CPUs without AVX-512)")
    ap.add_argument("--variants", default="base,wise")
    ap.add_argument("--posthoc", default="", metavar="SPEC",
                    help="issue 40's post-hoc peers, in hf-janus frontier --candidates syntax (each point scored)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--held-out", action="store_true",
                    help="also score held-out questions and choose on the validation ones (a fresh record, "
                         "results/real_study_<run>_held_out.json; give wise among the variants)")
    ap.add_argument("--tag", default="", metavar="NAME",
                    help="a record of its own, results/real_study_<run>[_held_out]_NAME.json (e.g. a data-free "
                         "held-out run beside the in-domain one)")
    ap.add_argument("--summarize", action="store_true")
    ap.add_argument("--margins", action="store_true", help="only θ0's answer margins and what θ̂ keeps of each bin")
    ap.add_argument("--work-dir", default=os.path.join(HERE, "cache", "real_study"))
    args = ap.parse_args()
    default_dtype = str(DTYPES[args.run]).replace("torch.", "")
    if args.dtype:
        DTYPES[args.run] = getattr(torch, args.dtype)
    args.label = args.run + ("" if args.dtype in (None, default_dtype) else f"_{args.dtype}")
    out_path = os.path.join(RESULTS, f"real_study_{args.label}{'_held_out' if args.held_out else ''}"
                                     f"{'_' + args.tag if args.tag else ''}.json")
    if args.held_out and not args.summarize and "wise" not in args.variants.split(","):
        raise SystemExit("--held-out needs wise among the variants: the held-out margins are read off its curve")
    if args.summarize:
        print(write_markdown(out_path))
        print(write_plot(out_path))
        return
    if args.margins:
        margins_only(args, out_path)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    s = bench.Settings()
    torch.manual_seed(s.seed)
    tok = AutoTokenizer.from_pretrained(smollm2.smollm2_dir())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    theta0, exact, data = prepare(args, s, tok, os.path.join(args.work_dir, args.label))
    record = {"run": args.run, "dtype": str(DTYPES[args.run]).replace("torch.", ""), "settings": asdict(s),
              "fine_tuning": data["fine_tuning"],
              "theta0_answer_generation_seconds": data["generation_seconds"], "points": {},
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "platform": platform.platform(), "torch": torch.__version__}}
    if os.path.isfile(out_path) and not args.held_out:  # a held-out record is never mixed with earlier points
        with open(out_path, encoding="utf-8") as fh:
            record["points"] = json.load(fh).get("points", {})
    # the first 64 replayed answers, scored like the others: is what stays lost lost on the replay itself?
    sets = {"nq": data["eval_nq"], "webq": data["eval_wq"], "replayed": data["pool"][:64]}
    scored = {}

    def save_data():
        atomic_write_text(os.path.join(args.work_dir, args.label, "data.json"), json.dumps(data))

    if args.held_out:
        sets.update(held_out_sets(s, tok, theta0, data, save_data))
        record["held_out_generation_seconds"] = data["held_out_generation_seconds"]

    def save():
        atomic_write_text(out_path, json.dumps(record, indent=1))

    def scored_point(point: dict, **extra) -> dict:
        """A point's record: its summaries, what it gives back of θ̂'s losses, its flips, and ``extra``."""
        return {"past_summary": point["past_summary"], "gsm_nll": point["gsm_nll"],
                "repair": repair_figures(point, scored["theta0"], scored["finetuned"]),
                "flips": flips(scored["theta0"], scored["finetuned"], point), **extra}

    def record_weights(label: str, weights: dict, note: str = "", **extra) -> None:
        """Score the model θ0 with ``weights``, record it under ``label``, log it and save."""
        point = evaluate(finetuned_model(theta0, weights), tok, sets, data["gsm"], pad)
        record["points"][label] = scored_point(point, **extra)
        log(f"[{label}] {note}{record['points'][label]['repair']}")
        save()

    for anchor in ("theta0", "finetuned"):
        model = theta0 if anchor == "theta0" else finetuned_model(theta0, exact)
        scored[anchor] = evaluate(model, tok, sets, data["gsm"], pad)
        log(f"[{anchor}] {scored[anchor]['past_summary']} gsm {scored[anchor]['gsm_nll']:.4f}")
    for anchor in ("theta0", "finetuned"):
        record["points"][anchor] = {"past_summary": scored[anchor]["past_summary"],
                                    "gsm_nll": scored[anchor]["gsm_nll"]}
    for name in filter(None, args.variants.split(",")):
        if name == "wise":
            for a in WISE_GRID:
                model = finetuned_model(theta0, {k: theta0.get_parameter(k).float()
                                                 + a * (w - theta0.get_parameter(k).float())
                                                 for k, w in exact.items()})
                point = evaluate(model, tok, sets, data["gsm"], pad)
                record["points"][f"wise a={a:g}"] = scored_point(point)
                log(f"[wise a={a:g}] {record['points'][f'wise a={a:g}']['repair']}")
            save()
            continue
        lever = levers(name)
        peer = next((kind for kind in PEERS if lever.get(kind)), None)
        start = exact
        if peer:
            start = peer_weights(peer, args, s, tok, theta0, data, os.path.join(args.work_dir, args.label),
                                 lever.get("lr"))
            save_data()
            trained = peer if "lr" not in lever else f"{peer}_lr{lever['lr']:g}"
            if set(lever) <= {"m", peer, "lr"}:  # the peer alone, as trained
                point = evaluate(finetuned_model(theta0, start), tok, sets, data["gsm"], pad)
                record["points"][name] = scored_point(
                    point, fine_tuning=data[f"{trained}_fine_tuning"],
                    preprocess_seconds=data.get(f"{trained}_preprocess_seconds"))
                log(f"[{name}] {record['points'][name]['repair']}")
                save()
                continue
        pool = replay_pool(s, data, lever["m"], tok, theta0, save_data)
        t = time.perf_counter()
        replay = variant_replay(lever, pool, tok, theta0)
        replay_s = time.perf_counter() - t
        config = variant_config(lever)
        model = finetuned_model(theta0, start)
        if not lever.get("fromhat"):  # with fromhat the passes start from θ̂: no JANUS point to make
            t = time.perf_counter()
            # an adapter's θ̂ is known exactly in float32 (θ0 + s·BA), more exactly than its bf16 model holds it
            peak, report = own_peak_bytes(lambda: rectify(
                model, theta0, replay, config, progress=False,
                finetuned=start if args.run != "full" or peer else None,
                new_task=new_task_samples(tok) if "repair" in lever else None,
                new_task_validation=new_task_validation_samples(tok) if lever.get("val") else None))
            seconds = time.perf_counter() - t
            point = evaluate(model, tok, sets, data["gsm"], pad)
            record["points"][name] = scored_point(
                point, replay_samples=len(replay), replay_tokens=sum(len(r["input_ids"]) for r in replay),
                replay_seconds=replay_s, rectify_seconds=seconds, peak_host_bytes=peak,
                jacobian_evaluations=report.num_jacobian_evals,
                stop_reason=report.stop_reason, replay_loss=report.replay_loss, config=config.to_dict(),
                timings=report.timings, repair_after_janus=None if report.repair is None else report.repair.to_dict())
            log(f"[{name}] {seconds:.0f}s, {report.num_jacobian_evals} evals: {record['points'][name]['repair']}")
            save()
        for label, weights in hybrids(name, lever, theta0, model, start):
            record_weights(label, weights, hybrid_of=name)
        for label, weights, cost in replay_trained(name, lever, theta0, start, replay, tok, config):
            record_weights(label, weights, f"{cost.seconds:.0f}s: ", hybrid_of=name,
                           replay_training_seconds=cost.seconds, replay_training_peak_bytes=cost.peak_memory_bytes)
            for sub, mixed in hybrids(label, lever, theta0, weights, start, prefix="k"):
                record_weights(sub, mixed, hybrid_of=label)
    if args.posthoc:
        replay = replay_samples(data["pool"][:64])
        for label, model, cost in posthoc_points(args.posthoc, theta0, exact, replay, tok):
            point = evaluate(model, tok, sets, data["gsm"], pad)
            record["points"][label] = scored_point(point, posthoc_cost=cost, rectify_seconds=cost["seconds"],
                                                   replay_samples=len(replay))
            log(f"[{label}] {cost['seconds']:.0f}s: {record['points'][label]['repair']}")
            save()
    save()
    print(write_markdown(out_path))
    print(write_plot(out_path))


def margins_only(args, out_path: str) -> None:
    """Add θ0's answer margins (and what θ̂ keeps per margin bin) to the run's record."""
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(smollm2.smollm2_dir())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    theta0, exact, data = prepare(args, bench.Settings(), tok, os.path.join(args.work_dir, args.label))
    table = margin_table(theta0, finetuned_model(theta0, exact), data, pad)
    with open(out_path, encoding="utf-8") as fh:
        record = json.load(fh)
    record["theta0_margins"] = table
    atomic_write_text(out_path, json.dumps(record, indent=1))
    print(json.dumps(table, indent=1))


def figure(v: Optional[float], spec: str = ".1f") -> str:
    """A table cell: ``v`` formatted, or empty when there is none."""
    return "" if v is None else format(v, spec)


def write_markdown(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        rec = json.load(fh)
    lines = ["| point | NLL rise undone NQ / WebQ (%) | EM back NQ / WebQ (%) | token EM NQ / WebQ (%) | "
             "first-token agreement NQ (%) | EM back, replayed (%) | AP2 (%) | vs WiSE-FT, EM / NLL (NQ) | "
             "Jacobian evals | replay passes fwd / bwd | seconds | peak host GiB | replay samples |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    for name, p in rec["points"].items():
        r = p.get("repair", {})
        ps = p["past_summary"]
        cost = p.get("posthoc_cost") or {}
        passes = ("shared" if cost.get("reused") else f"{cost['forward_passes']:g} / {cost['backward_passes']:g}"
                  if cost.get("forward_passes") or cost.get("backward_passes") else "")
        peak = p.get("peak_host_bytes", cost.get("peak_host_bytes", p.get("replay_training_peak_bytes")))
        seconds = p.get("rectify_seconds", p.get("replay_training_seconds"))  # a kl point: its passes only
        margin = ("" if name.startswith("wise") or r.get("ap2") is None else
                  f"{figure(wise_margin(rec['points'], r, 'em_back'), '+.1f')} / "
                  f"{figure(wise_margin(rec['points'], r, 'nll_undone'), '+.1f')}")
        lines.append(
            f"| {name} | {figure(r.get('nq', {}).get('nll_undone'))} / {figure(r.get('webq', {}).get('nll_undone'))} "
            f"| {figure(r.get('nq', {}).get('em_back'))} / {figure(r.get('webq', {}).get('em_back'))} "
            f"| {figure(ps['nq']['em'])} / {figure(ps['webq']['em'])} | {figure(ps['nq']['first_token_acc'])} "
            f"| {figure(r.get('replayed', {}).get('em_back'))} | {figure(r.get('ap2'))} | {margin} "
            f"| {p.get('jacobian_evaluations', '')} | {passes} | {figure(seconds, '.0f')} "
            f"| {figure(peak / 2**30 if peak else None, '.2f')} | {p.get('replay_samples', '')} |")
    lines += ["", "Where the lost answers flip (NQ never replayed / WebQuestions): answers θ0 reproduces and θ̂ does "
              "not, how many of those θ̂ already misses at their first token, how many each point gives back (of those "
              "lost at the first token), and answers θ̂ kept that the point loses.", "",
              "| point | lost by θ̂ | of which at the first token | back | back, of those at the first token | "
              "newly lost |", "|---|---:|---:|---:|---:|---:|"]
    for name, p in rec["points"].items():
        fl = p.get("flips")
        if not fl:
            continue

        def pair(key):
            return f"{fl['nq'][key]} / {fl['webq'][key]}"

        lines.append(f"| {name} | {pair('lost')} | {pair('lost_at_first_token')} | {pair('back')} "
                     f"| {pair('back_of_those_lost_at_first_token')} | {pair('newly_lost')} |")
    margins = rec.get("theta0_margins")
    if margins:
        lines += ["", "θ0's answers by their smallest log-probability margin (chosen token minus runner-up, over the "
                  "answer's tokens), and how many θ̂ still reproduces (NQ never replayed / WebQuestions; median "
                  f"margin {margins['nq_median_margin']:.2f} / {margins['webq_median_margin']:.2f} nats):", "",
                  "| margin (nats) | answers | kept by θ̂ |", "|---|---:|---:|"]
        for a, b in zip(margins["nq"], margins["webq"]):
            lines.append(f"| {a['margin']} | {a['answers']} / {b['answers']} "
                         f"| {a['kept_by_finetuned']} / {b['kept_by_finetuned']} |")
    text = "\n".join(lines) + "\n" + held_out_markdown(rec)
    with open(path[:-5] + ".md", "w", encoding="utf-8") as fh:
        fh.write(f"# The real-model study ({rec['run']}): benchmarks/forgetting/real_study.py\n\n" + text)
    return text


def held_out_markdown(rec: dict) -> str:
    """The held-out questions' table and the point :func:`chosen_point` picks on the validation questions ("" for a
    record without held-out questions)."""
    points = rec["points"]
    if "nq_held_out" not in points.get("finetuned", {}).get("past_summary", {}):
        return ""

    choice = chosen_point(points)
    kept = points["finetuned"]["past_summary"]
    lines = ["", f"Held-out questions (never scored or replayed before; θ0's EM there is 100 by construction, θ̂ keeps "
             f"{figure(kept['nq_held_out']['em'])} / {figure(kept['webq_held_out']['em'])}). The choice, made on the "
             f"validation questions above (AP2 ≥ {CHOICE_MIN_AP2:g}, the most exact matches back): **{choice}**.", "",
             "| point | EM back NQ / WebQ, validation (%) | EM back NQ / WebQ, held out (%) | NLL rise undone NQ / "
             "WebQ, held out (%) | AP2 (%) | vs WiSE-FT EM NQ / WebQ, held out | vs WiSE-FT NLL NQ / WebQ, held out |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, p in points.items():
        r = p.get("repair")
        if not r:
            continue
        margins = ["", ""]
        if not name.startswith("wise") and r.get("ap2") is not None:
            margins = [" / ".join(figure(wise_margin(points, r, key, subset), "+.1f") for subset in
                                  ("nq_held_out", "webq_held_out")) for key in ("em_back", "nll_undone")]
        bold = "**" if name == choice else ""
        lines.append(f"| {bold}{name}{bold} | {figure(r['nq']['em_back'])} / {figure(r['webq']['em_back'])} "
                     f"| {figure(r['nq_held_out']['em_back'])} / {figure(r['webq_held_out']['em_back'])} "
                     f"| {figure(r['nq_held_out']['nll_undone'])} / {figure(r['webq_held_out']['nll_undone'])} "
                     f"| {figure(r.get('ap2'))} | {margins[0]} | {margins[1]} |")
    return "\n".join(lines) + "\n"


def wise_margin(points: dict, repair: dict, key: str, subset: str = "nq") -> Optional[float]:
    """How far a point's ``key`` (``em_back`` or ``nll_undone``) on ``subset`` lies above the WiSE-FT curve at its
    AP2, as the frontier measures it (:func:`benchmarks.forgetting.variants.above_wise`: linear between the curve's
    points, θ0 at AP2 0 with all back and θ̂ at AP2 100 with nothing back its ends); None outside the curve's range."""
    wise = [(float(name.split("=")[1]), p["repair"]["ap2"], p["repair"][subset][key])
            for name, p in points.items() if name.startswith("wise a=")]
    return above_wise((repair["ap2"], repair[subset][key]), (0.0, 100.0), (100.0, 0.0), wise)


def write_plot(path: str) -> str:
    """``results/real_study_<run>.png``: each point's AP2 against what it gives back on the never-replayed NQ-open
    questions, exact matches (left) and answer NLL (right), the WiSE-FT curve joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path, encoding="utf-8") as fh:
        rec = json.load(fh)
    points = {name: p["repair"] for name, p in rec["points"].items() if p.get("repair", {}).get("ap2") is not None}
    # the post-hoc peers' grid points, one curve per kind and setting (their labels with the numbers taken out)
    peers: dict[str, list[str]] = {}
    for name, p in rec["points"].items():
        if p.get("posthoc_cost") is not None and name in points:
            peers.setdefault(re.sub(r"\s*[×=]?\d+(\.\d+)?(e-\d+)?", "", name), []).append(name)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, key, title in ((axes[0], "em_back", "exact matches with θ0's answers back (%)"),
                           (axes[1], "nll_undone", "rise in θ0-answer NLL undone (%)")):
        wise = sorted((r["ap2"], r["nq"][key]) for name, r in points.items() if name.startswith("wise"))
        if wise:
            ax.plot(*zip(*wise), "o-", color="0.6", label="WiSE-FT")
        for group, names in peers.items():
            ax.plot(*zip(*sorted((points[n]["ap2"], points[n]["nq"][key]) for n in names)), "^--", ms=4, lw=0.8,
                    label=group[:40])
        for name, r in points.items():
            if name.startswith("wise") or any(name in names for names in peers.values()):
                continue
            ax.plot(r["ap2"], r["nq"][key], "s", color="k")
            ax.annotate(name, (r["ap2"], r["nq"][key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axvline(95, color="0.85", lw=0.8)
        ax.set_xlabel("AP2: share of the GSM8K NLL gain kept (%)")
        ax.set_ylabel(title + ", NQ never replayed")
        ax.grid(alpha=0.3)
    axes[0].axhline(50, color="0.85", lw=0.8)
    axes[1].axhline(70, color="0.85", lw=0.8)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"SmolLM2-135M-Instruct, {rec['run']} ({rec['dtype']}): JANUS settings against WiSE-FT")
    fig.tight_layout()
    out = path[:-5] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    sys.exit(main())
