"""``hf-janus demo``: forgetting and its repair on a tiny model, on CPU, in about a minute.

1. "Pretrain" a tiny Llama until it has memorized NQ-open question/answer pairs (the past task).
2. Fine-tune it on GSM8K worked solutions (the new task): it forgets the QA pairs.
3. Rectify with JANUS, replaying a part of the memorized pairs, and measure both tasks again on pairs
   that were *not* replayed.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from importlib import resources
from typing import Optional

import torch
from tqdm.auto import tqdm

from .config import JanusConfig
from .rectifier import rectify
from .report import RectificationReport

logger = logging.getLogger(__name__)

PAD_ID, BOS_ID, VOCAB = 0, 1, 258  # bytes are shifted by 2


def encode(text: str, max_len: int) -> list[int]:
    """Byte-level tokens: no tokenizer files needed, every string is representable."""
    return [BOS_ID] + [b + 2 for b in text.encode("utf-8")][: max_len - 1]


def _read_jsonl(name: str) -> list[dict]:
    text = resources.files("hf_janus").joinpath("data", name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _sample(prompt: str, answer: str, max_len: int) -> dict:
    """A training/eval sample whose labels cover only the answer (prompt tokens are -100)."""
    a = [b + 2 for b in answer.encode("utf-8")][: max_len // 2]
    p = encode(prompt, max_len - len(a))  # long questions are cut, never the answer
    ids = p + a
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * len(p) + a}


def qa_samples(n: int, max_len: int = 96) -> list[dict]:
    rows = _read_jsonl("nq_open_dev_400.jsonl")[:n]
    return [_sample(f"Q: {r['question']}?\nA:", f" {r['answer'][0]}\n", max_len) for r in rows]


def math_samples(start: int, n: int, max_len: int = 160) -> list[dict]:
    rows = _read_jsonl("gsm8k_train_300.jsonl")[start:start + n]
    return [_sample(f"Q: {r['question']}\nA:", f" {r['answer']}\n", max_len) for r in rows]


def full_text(samples: list[dict]) -> list[dict]:
    """Same tokens with every position supervised (how the past task was learned and is replayed)."""
    return [{"input_ids": s["input_ids"], "attention_mask": s["attention_mask"]} for s in samples]


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=None, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _batch(samples: list[dict]) -> dict[str, torch.Tensor]:
    from .replay import prepare_replay

    return prepare_replay(samples, len(samples))[0]


@torch.no_grad()
def answer_nll(model, samples: list[dict], batch_size: int = 32) -> float:
    """Mean per-token negative log-likelihood of the labelled (answer) tokens."""
    from .capture import replay_losses
    from .replay import prepare_replay

    return replay_losses(model, prepare_replay(samples, batch_size)).loss


def train(model, samples: list[dict], steps: int, lr: float, batch_size: int, seed: int, desc: str,
          progress: bool = True) -> None:
    """Plain AdamW loop; a Trainer would do the same, this keeps the demo dependency-light and fast."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        idx = torch.randint(len(samples), (batch_size,), generator=gen).tolist()
        batch = _batch([samples[i] for i in idx])
        labels = batch.get("labels", batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


@dataclass
class DemoResult:
    table: dict[str, dict[str, float]]  # model -> {"past_nll", "new_nll"}
    report: RectificationReport
    seconds: float

    def markdown(self) -> str:
        rows = ["| model | past task NLL (QA, not replayed) ↓ | new task NLL (GSM8K held out) ↓ |", "|---|---|---|"]
        for name, vals in self.table.items():
            rows.append(f"| {name} | {vals['past_nll']:.3f} | {vals['new_nll']:.3f} |")
        return "\n".join(rows)


def run_demo(seed: int = 0, quick: bool = False, progress: bool = True, config: Optional[JanusConfig] = None) -> DemoResult:
    """Run the whole story and return the before/after table and the rectification report."""
    start = time.perf_counter()
    n_qa, n_replay = (48, 24) if quick else (96, 48)
    pretrain_steps, finetune_steps = (150, 40) if quick else (300, 100)
    qa = qa_samples(n_qa)
    replay, held_out = full_text(qa[:n_replay]), qa[n_replay:]
    math_train, math_test = math_samples(0, 200), math_samples(200, 40)

    model = tiny_llama(seed)
    train(model, full_text(qa), pretrain_steps, 3e-3, 32, seed, "pretraining on NQ-open QA", progress)
    pretrained = copy.deepcopy(model.state_dict())
    table = {"pretrained θ0": {"past_nll": answer_nll(model, held_out), "new_nll": answer_nll(model, math_test)}}

    train(model, math_train, finetune_steps, 1e-3, 16, seed + 1, "fine-tuning on GSM8K", progress)
    table["fine-tuned θ̂"] = {"past_nll": answer_nll(model, held_out), "new_nll": answer_nll(model, math_test)}

    config = config or JanusConfig(rank=32, replay_batch_size=48)
    report = rectify(model, pretrained, replay, config, progress=progress)
    table["JANUS-rectified"] = {"past_nll": answer_nll(model, held_out), "new_nll": answer_nll(model, math_test)}
    return DemoResult(table=table, report=report, seconds=time.perf_counter() - start)
