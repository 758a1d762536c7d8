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
