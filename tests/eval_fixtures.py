"""A character-level tokenizer and JSONL writers for the lm-eval tests (no network, no tokenizer training)."""

from __future__ import annotations

import json
import os

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?:.\n,'"


def char_tokenizer():
    """One token per character; ``<pad>``, ``<bos>``, ``<eos>`` are 0, 1, 2 (vocabulary of 71)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def write_jsonl(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


def train_on_texts(model, texts: list[str], tok, steps: int, lr: float, seed: int = 0) -> None:
    """A few full-batch AdamW steps of language modelling on ``texts`` (every trainable parameter)."""
    import torch

    torch.manual_seed(seed)
    batch = tok(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


PAST = [f"the cat sat on mat {i}" for i in range(12)]
NEW = [f"{i} plus {i} is {2 * i}" for i in range(12)]


def saved_lora_setting(folder, target_modules, base_steps: int = 40, lora_steps: int = 25) -> dict:
    """A tiny Llama θ0 that learned PAST and a LoRA r=4 trained from it on NEW, both saved under ``folder``
    (``base``, ``adapter``), the JSONL past and new tasks (``past``, ``new``), the replay (PAST[6:]) and the tokenizer;
    ``lora`` is the trained PeftModel."""
    import copy

    from peft import LoraConfig, get_peft_model
    from testing_utils import build_tiny

    tok = char_tokenizer()
    base = build_tiny("llama", seed=0, vocab=len(tok))
    train_on_texts(base, PAST, tok, steps=base_steps, lr=1e-2)
    base_dir = os.path.join(folder, "base")
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=target_modules))
    lora.peft_config["default"].base_model_name_or_path = base_dir
    train_on_texts(lora, NEW, tok, steps=lora_steps, lr=1e-2, seed=1)
    adapter_dir = os.path.join(folder, "adapter")
    lora.save_pretrained(adapter_dir)
    return {"tok": tok, "base_dir": base_dir, "adapter_dir": adapter_dir, "lora": lora,
            "past": write_jsonl(os.path.join(folder, "past.jsonl"),
                                [{"prompt": t[:8], "completion": t[9:]} for t in PAST[:6]]),
            "new": write_jsonl(os.path.join(folder, "new.jsonl"),
                               [{"prompt": t[:6], "completion": t[7:]} for t in NEW[:6]]),
            "replay": [{"input_ids": tok(t)["input_ids"]} for t in PAST[6:]]}


def tiny_frontier_setting() -> tuple:
    """``(tokenizer, θ0, θ̂, replay)``: a tiny Llama that learned PAST, fine-tuned on NEW, replaying PAST[6:]."""
    import copy

    from testing_utils import build_tiny

    tok = char_tokenizer()
    base = build_tiny("llama", seed=0, vocab=len(tok))
    train_on_texts(base, PAST, tok, steps=40, lr=1e-2)
    tuned = copy.deepcopy(base)
    train_on_texts(tuned, NEW, tok, steps=25, lr=1e-2, seed=1)
    replay = [{"input_ids": tok(t)["input_ids"]} for t in PAST[6:]]
    return tok, base, tuned, replay


def nll_scorer(tok):
    """A frontier scorer without lm-eval: each side's mean next-token loss on its texts (a loss: lower is better);
    ``score.calls`` counts the models it scored."""
    import torch

    from hf_janus.evaluation.harness import TaskResult

    sides = {"past": tok(PAST[:6], padding=True, return_tensors="pt"),
             "new": tok(NEW[:6], padding=True, return_tensors="pt")}

    def score(model):
        score.calls += 1
        out = {}
        for name, batch in sides.items():
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            with torch.no_grad():
                out[name] = TaskResult(float(model(**batch, labels=labels).loss), "nll", False)
        return out

    score.calls = 0
    return score
