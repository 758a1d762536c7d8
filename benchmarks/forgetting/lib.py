"""Data, tokenizer, model, training and evaluation helpers of the forgetting benchmark (see README.md)."""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from hf_janus.evaluation.scoring import exact_match as em

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.normpath(os.path.join(HERE, "..", "data"))
#: The environment variable that moves the checkpoint cache (:func:`cache_dir`).
CACHE_ENV = "HF_JANUS_BENCHMARK_CACHE"
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def cache_dir() -> str:
    """Where the pretrained checkpoints are kept between runs: ``$HF_JANUS_BENCHMARK_CACHE``, else
    ``~/.cache/hf-janus/benchmarks/forgetting``. Outside the repository, because a checkpoint is rebuilt (seeded)
    whenever its folder is missing, and model weights do not belong in git."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf-janus", "benchmarks",
                                                     "forgetting")


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
def read_jsonl(name: str) -> list[dict]:
    with open(os.path.join(DATA_DIR, name), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass
class QA:
    question: str
    answers: list[str]
    source: str

    @property
    def prompt(self) -> str:
        return f"Q: {self.question.rstrip(' ?')}?\nA:"

    @property
    def target(self) -> str:  # the answer the model memorizes: the first reference answer
        return " " + self.answers[0]


@dataclass
class Math:
    question: str
    answer: str

    @property
    def prompt(self) -> str:
        return f"Q: {self.question}\nA:"

    @property
    def target(self) -> str:  # GSM8K worked solution without the calculator annotations <<...>>
        return " " + re.sub(r"<<[^>]*>>", "", self.answer)


@dataclass
class Splits:
    replay: list[QA]  # memorized NQ-open pairs, replayed by JANUS
    nq_eval: list[QA]  # memorized NQ-open pairs, evaluated, never replayed
    wq_eval: list[QA]  # memorized WebQuestions pairs, evaluated, never replayed
    gsm_train: list[Math]
    gsm_test: list[Math]

    @property
    def memorized(self) -> list[QA]:
        return self.replay + self.nq_eval + self.wq_eval


REPLAY_POOLS = ("nq_open_dev", "nq_open_dpr")


def load_splits(n_replay: int, n_eval: int, n_gsm_train: int, n_gsm_test: int,
                replay_pool: str = "nq_open_dev") -> Splits:
    """``replay_pool="nq_open_dev"``: the replay pairs follow the evaluation pairs in the NQ-open dev subset (768
    rows, so at most 768 - n_eval). ``"nq_open_dpr"``: they are the first NQ-open pairs of DPR's dev split (8,192
    rows), for replays larger than the dev subset holds."""
    nq = [QA(r["question"], r["answer"], "nq") for r in read_jsonl("nq_open_dev_subset.jsonl")]
    wq = [QA(r["qText"], r["answers"], "wq") for r in read_jsonl("webquestions_trainmodel_subset.jsonl")]
    gsm_train = [Math(r["question"], r["answer"]) for r in read_jsonl("gsm8k_train_subset.jsonl")]
    gsm_test = [Math(r["question"], r["answer"]) for r in read_jsonl("gsm8k_test_subset.jsonl")]
    if replay_pool not in REPLAY_POOLS:
        raise ValueError(f"replay_pool must be one of {REPLAY_POOLS}, got {replay_pool!r}")
    if replay_pool == "nq_open_dpr":
        pool = [QA(r["question"], r["answers"], "nq") for r in read_jsonl("nq_open_dpr_dev_subset.jsonl")]
        evaluated = {q.question.lower() for q in nq[:n_eval] + wq[:n_eval]}
        replay = [q for q in pool if q.question.lower() not in evaluated][:n_replay]
    else:
        # Evaluation pairs first, replay pairs after them: the two sets are disjoint by construction.
        replay = nq[n_eval:n_eval + n_replay]
    if len(replay) < n_replay or n_eval > len(nq) or n_eval > len(wq):
        raise ValueError("not enough QA rows in benchmarks/data; rerun benchmarks/data/make_subsets.py")
    return Splits(replay=replay, nq_eval=nq[:n_eval], wq_eval=wq[:n_eval],
                  gsm_train=gsm_train[:n_gsm_train], gsm_test=gsm_test[:n_gsm_test])


# ---------------------------------------------------------------------------------------------------------
# tokenizer: a small byte-level BPE trained with `tokenizers` on the benchmark's own text
# ---------------------------------------------------------------------------------------------------------
class Tok:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tk = Tokenizer.from_file(path)
        self.path = path
        self.pad_id, self.bos_id, self.eos_id = (self.tk.token_to_id(t) for t in (PAD, BOS, EOS))
        self.vocab_size = self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def hf(self, add_bos: bool = False):
        """The same tokenizer as a transformers ``PreTrainedTokenizerFast`` (for ``Trainer``); with ``add_bos`` it
        puts <bos> before every text, as the benchmark's samples and prompts start (for lm-eval)."""
        from tokenizers import Tokenizer
        from tokenizers.processors import TemplateProcessing
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer.from_file(self.path)
        if add_bos:
            tk.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, bos_token=BOS, eos_token=EOS)


def train_tokenizer(texts: list[str], vocab_size: int, path: str) -> Tok:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD, BOS, EOS],
                            show_progress=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)
    return Tok(path)


def make_sample(tok: Tok, prompt: str, target: str, max_len: int, label_prompt: bool) -> dict:
    """``<bos> prompt target <eos>``; labels cover the target (and the prompt when ``label_prompt``).

    Long prompts are cut from the left of the target budget, never the answer's start.
    """
    p = [tok.bos_id] + tok.encode(prompt)
    a = tok.encode(target) + [tok.eos_id]
    a = a[: max(1, max_len - len(p))] if len(p) < max_len else a[: max_len // 2]
    p = p[: max_len - len(a)]
    ids = p + a
    labels = (list(ids) if label_prompt else [-100] * len(p) + a)
    labels[0] = -100  # <bos> is never a target
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def collate(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    out = {"input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
           "attention_mask": torch.zeros(len(samples), width, dtype=torch.long),
           "labels": torch.full((len(samples), width), -100, dtype=torch.long)}
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][i, :n] = torch.tensor(s["input_ids"])
        out["attention_mask"][i, :n] = 1
        out["labels"][i, :n] = torch.tensor(s["labels"])
    return out


class Collator:
    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return collate(samples, self.pad_id)


# ---------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------
def make_model(vocab_size: int, tok: Tok, hidden: int, layers: int, intermediate: int, heads: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def pretrain(model, samples: list[dict], steps: int, lr: float, batch_size: int, seed: int, pad_id: int,
             log_every: int = 200, log=print) -> None:
    """Plain AdamW loop (linear warm-up, cosine decay) over shuffled epochs of ``samples``."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    model.train()
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(samples), generator=gen).tolist()
        idx, order = order[:batch_size], order[batch_size:]
        batch = collate([samples[i] for i in idx], pad_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log_every and (step + 1) % log_every == 0:
            log(f"  pretrain step {step + 1}/{steps}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def answer_nll(model, samples: list[dict], pad_id: int, batch_size: int = 64) -> float:
    """Mean per-token negative log-likelihood of the labelled tokens (token-weighted over the set)."""
    model.eval()
    total, count = 0.0, 0
    # Batches of similar lengths carry less padding (GSM8K answers: 56-192 tokens); the sum is order-free.
    samples = sorted(samples, key=lambda s: len(s["input_ids"]))
    for i in range(0, len(samples), batch_size):
        batch = collate(samples[i:i + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(count, 1)


@torch.no_grad()
def greedy_answers(model, tok: Tok, prompts: list[str], max_new_tokens: int, batch_size: int = 128) -> list[str]:
    """Greedy continuation of each prompt (left padded, KV cache), cut at <eos> or a newline."""
    model.eval()
    out: list[str] = []
    for i in range(0, len(prompts), batch_size):
        enc = [[tok.bos_id] + tok.encode(p) for p in prompts[i:i + batch_size]]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(enc), width, dtype=torch.long)
        for j, e in enumerate(enc):
            ids[j, width - len(e):] = torch.tensor(e)
            mask[j, width - len(e):] = 1
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        for row in gen[:, width:].tolist():
            if tok.eos_id in row:
                row = row[: row.index(tok.eos_id)]
            out.append(tok.decode(row).split("\n")[0].strip())
    return out


def exact_match(predictions: list[str], qas: list[QA]) -> float:
    """EM (%) of answers read off directly (:func:`greedy_answers`): the pre-harness path, kept for the pretraining
    check and for compare_em.py."""
    hits = [em(p, qa.answers) for p, qa in zip(predictions, qas)]
    return 100.0 * sum(hits) / max(len(hits), 1)


def write_qa_jsonl(path: str, qas: list[QA]) -> str:
    """The pairs as the QA JSONL that hf_janus.evaluation.qa_task reads (question, answers)."""
    with open(path, "w", encoding="utf-8") as fh:
        for qa in qas:
            fh.write(json.dumps({"question": qa.question, "answers": qa.answers}) + "\n")
    return path


class HarnessEM:
    """Exact match of greedy answers through lm-evaluation-harness (hf_janus.evaluation), per QA set.

    The same prompt ("Q: <question>?\nA:" after <bos>), greedy decoding, cut at a newline or <eos>, and SQuAD
    normalization as :func:`greedy_answers` + :func:`exact_match`; compare_em.py measures the two side by side.
    """

    def __init__(self, tok: Tok, sets: dict[str, list[QA]], max_new_tokens: int, batch_size: int = 128):
        from hf_janus.evaluation import qa_task
        from hf_janus.evaluation.harness import Scorer, resolve_tasks

        self.folder = tempfile.mkdtemp(prefix="janus-em-")
        atexit.register(shutil.rmtree, self.folder, True)
        self.tasks = {name: resolve_tasks([qa_task(write_qa_jsonl(os.path.join(self.folder, f"{name}.jsonl"), qas),
                                                   name=name, max_new_tokens=max_new_tokens)])[0]
                      for name, qas in sets.items()}
        self.scorers = {name: Scorer([task], tok.hf(add_bos=True), batch_size=batch_size)
                        for name, task in self.tasks.items()}

    def __call__(self, model, names: list[str]) -> dict[str, float]:
        """EM (%) of ``model`` on the named sets."""
        out = {}
        for name in names:
            out[name] = 100.0 * self.scorers[name](model)[name].score
        return out


@dataclass
class EvalSet:
    """Everything measured on one model: knowledge (EM + answer NLL) and the new task (answer NLL)."""

    tok: Tok
    nq: list[QA]
    wq: list[QA]
    nq_samples: list[dict]
    wq_samples: list[dict]
    gsm_samples: list[dict]
    replay: list[QA] = field(default_factory=list)  # the replayed pairs: a diagnostic, never in AP1
    max_new_tokens: int = 16
    seconds: list[float] = field(default_factory=list)
    harness: Optional[HarnessEM] = None

    def __post_init__(self) -> None:
        sets = {"nq": self.nq, "wq": self.wq, **({"replay": self.replay} if self.replay else {})}
        self.harness = HarnessEM(self.tok, sets, self.max_new_tokens)

    def __call__(self, model, with_replay: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        pad = self.tok.pad_id
        em_sets = ["nq", "wq"] + (["replay"] if with_replay and self.replay else [])
        em_scores = self.harness(model, em_sets)
        out = {
            "nq_em": em_scores["nq"], "wq_em": em_scores["wq"],
            "nq_nll": answer_nll(model, self.nq_samples, pad), "wq_nll": answer_nll(model, self.wq_samples, pad),
            "gsm_nll": answer_nll(model, self.gsm_samples, pad, batch_size=32),
        }
        if "replay" in em_scores:
            out["replay_em"] = em_scores["replay"]
        self.seconds.append(time.perf_counter() - t0)
        return out


def ap_metrics(m: dict[str, float], pre: dict[str, float], ff: Optional[dict[str, float]]) -> dict[str, float]:
    """AP1 / AP2 / AP (paper, Sec. 4.1 "Metrics").

    AP1: mean over the knowledge sets (NQ-open, WebQuestions) of exact match relative to the pretrained θ0.
    AP2: new-task score relative to full fine-tuning (FF). The score of the new task is the GSM8K answer
    NLL *reduction* from θ0 (what fine-tuning taught), so AP2 = (NLL_θ0 − NLL) / (NLL_θ0 − NLL_FF).
    AP = (AP1 + AP2) / 2.
    """
    ap1 = 100.0 * 0.5 * (m["nq_em"] / pre["nq_em"] + m["wq_em"] / pre["wq_em"])
    out = {"ap1": ap1}
    if ff is not None:
        ap2 = 100.0 * (pre["gsm_nll"] - m["gsm_nll"]) / (pre["gsm_nll"] - ff["gsm_nll"])
        out.update(ap2=ap2, ap=0.5 * (ap1 + ap2))
    return out
