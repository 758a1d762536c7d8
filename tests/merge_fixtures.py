"""Builders for the merger tests: a tiny saved base model (with a character tokenizer), adapters of every
kind trained for a few steps with PEFT, and small replay files. Everything is local and offline."""

from __future__ import annotations

import json
import os
import string
from typing import Optional

import torch
from testing_utils import VOCAB, build_tiny

from hf_janus import JanusConfig

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
CHARS = list(string.ascii_lowercase) + list(" .?!,:'0123456789")[:VOCAB - len(SPECIALS) - 26 - 1]


def char_tokenizer():
    """A character-level fast tokenizer (BOS prepended) whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", pair="[BOS] $A $B",
                                                       special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")


def save_base(path, seed: int = 0, max_shard_size: Optional[str] = None, tokenizer: bool = True, **overrides) -> str:
    """Save a tiny 2-layer Llama (hidden 16) to ``path``; ``overrides`` change its config (wrong-shape bases)."""
    if overrides:
        import transformers as tf

        torch.manual_seed(seed)
        common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False)
        common.update(overrides)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    else:
        model = build_tiny("llama", seed=seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        char_tokenizer().save_pretrained(path)
    return os.fspath(path)


def load_base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.fspath(path)).eval()


def peft_config(kind: str):
    """The PEFT config of each adapter kind the tests cover."""
    from peft import LoHaConfig, LoraConfig

    if kind == "lora":
        return LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    if kind == "rslora-patterns":
        return LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                          rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    if kind == "dora":
        return LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"])
    if kind == "pissa":
        return LoraConfig(r=3, lora_alpha=6, init_lora_weights="pissa", target_modules=["q_proj", "o_proj"])
    if kind == "pissa-niter":
        return LoraConfig(r=3, lora_alpha=3, init_lora_weights="pissa_niter_2", target_modules=["q_proj", "o_proj"])
    if kind == "loha":
        return LoHaConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    if kind == "embed-mts":
        return LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"])
    raise ValueError(kind)


def train_adapter(base_dir, out_dir, kind: str, steps: int = 2, seed: int = 0, lr: float = 2e-2,
                  initial_dir=None, converted_dir=None, base_name: Optional[str] = None) -> str:
    """Create a ``kind`` adapter on the base in ``base_dir``, train it a few AdamW steps, save it.

    ``initial_dir``: also save the adapter right after initialization (PiSSA-like kinds, as PEFT's examples);
    ``converted_dir``: also save it converted to a plain LoRA relative to the original base
    (``path_initial_model_for_weight_conversion``). ``base_name`` overrides ``base_model_name_or_path``.
    """
    from peft import get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_base(base_dir), peft_config(kind))
    if base_name is not None:
        model.peft_config["default"].base_model_name_or_path = base_name
    if initial_dir is not None:
        init = model.peft_config["default"].init_lora_weights
        model.peft_config["default"].init_lora_weights = True
        model.save_pretrained(initial_dir)
        model.peft_config["default"].init_lora_weights = init
    gen = torch.Generator().manual_seed(seed + 7)
    data = torch.randint(0, VOCAB, (6, 10), generator=gen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=data, labels=data).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out_dir)
    if converted_dir is not None:
        model.save_pretrained(converted_dir, path_initial_model_for_weight_conversion=os.fspath(initial_dir))
    return os.fspath(out_dir)


TEXTS = [
    "the quick brown fox jumps over the lazy dog.",
    "paris is the capital of france.",
    "what is two plus two? four.",
    "a stitch in time saves nine!",
    "hello world, hello tests.",
    "rome was not built in a day.",
    "to be or not to be.",
    "knowledge is power: keep it.",
]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return os.fspath(path)


def text_rows(n: int = 6) -> list[dict]:
    return [{"text": TEXTS[i % len(TEXTS)]} for i in range(n)]


def qa_rows(n: int = 6) -> list[dict]:
    return [{"prompt": f"q: {t.split()[0]} ", "response": " ".join(t.split()[1:])} for t in TEXTS[:n]]


def fast_config(**kw) -> JanusConfig:
    """Single-step JANUS without compression: ΔW_rect is exactly the projection, and it runs in ~a second."""
    base = dict(tau=0.0, compression_rank=None, replay_batch_size=8)
    base.update(kw)
    return JanusConfig(**base)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 13, 2, 30, 11], [7, 3, 3, 40, 12, 0, 8]])
