"""Shared plumbing of the example scripts: data, a tiny offline model, evaluation and a result table.

Everything a newcomer needs to adapt is in the scripts themselves (``finetune_full.py``, ``finetune_lora.py``,
``finetune_pissa.py``); this module only keeps them short. The examples read

* the **past task** (what the model should not forget): NQ-open questions with short answers
  (``google-research-datasets/nq_open``, ``validation`` split), and
* the **new task** (what it is fine-tuned on): GSM8K worked solutions (``openai/gsm8k``, ``main``, ``train``),

both through ``datasets.load_dataset``. With ``--tiny`` they use the excerpts bundled with hf-janus instead and a
tiny Llama built locally (byte-level tokenizer, briefly "pretrained" on the past task so that there is something
to forget), so the scripts run in seconds on a CPU with no network at all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Optional

import torch
from torch import nn

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B"
PAST_TASK = ("google-research-datasets/nq_open", None, "validation")  # dataset id, config, split
NEW_TASK = ("openai/gsm8k", "main", "train")
BUNDLED = {"past": "nq_open_dev_400.jsonl", "new": "gsm8k_train_300.jsonl"}


# ---- command line --------------------------------------------------------------------------------------------
def build_parser(description: str, *, lr: float, tiny_lr: float) -> argparse.ArgumentParser:
    """The options every example shares; the scripts add their own (LoRA rank, output format, ...)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hub model id or local directory of a causal LM (with its tokenizer)")
    p.add_argument("--tiny", action="store_true",
                   help="offline smoke run: build a tiny Llama under OUTPUT/tiny-base and use the NQ-open/GSM8K "
                        "excerpts bundled with hf-janus instead of --model and the Hub datasets")
    p.add_argument("--output-dir", default="out", help="where the trained + rectified model and results.json go")
    p.add_argument("--train-samples", type=int, help="GSM8K training examples (new task)")
    p.add_argument("--replay-samples", type=int, help="NQ-open examples replayed by JANUS (m; 256 in the paper)")
    p.add_argument("--eval-samples", type=int,
                   help="other NQ-open examples (never replayed) and GSM8K examples (never trained on) to measure on")
    p.add_argument("--max-length", type=int, help="cut every example to this many tokens")
    p.add_argument("--steps", type=int, help="optimizer steps of fine-tuning")
    p.add_argument("--batch-size", type=int, help="per-device training batch size")
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--tiny-pretrain-steps", type=int, default=150,
                   help="with --tiny: AdamW steps that teach the tiny model the past task first")
    p.add_argument("--seed", type=int, default=0)
    jan = p.add_argument_group("JANUS (see JanusConfig)")
    jan.add_argument("--tau", type=float, default=0.95, help="acceptance threshold τ (0 = single-step JANUS)")
    jan.add_argument("--beta", type=float, default=0.7, help="step-size decay β")
    jan.add_argument("--compression-rank", type=int, default=32,
                     help="rank r of JANUS's sequence compression (0 = none, exact)")
    jan.add_argument("--janus-max-steps", type=int, default=50, help="cap on rectification steps")
    jan.add_argument("--replay-batch-size", type=int, default=8, help="replay samples per forward/backward pass")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the output directory to this Hub repo")
    p.set_defaults(_lr=(lr, tiny_lr))
    p.epilog = ("defaults (real model / --tiny): " + ", ".join(
        f"--{k.replace('_', '-')} {REAL[k]} / {TINY[k]}" for k in REAL) + f", --lr {lr} / {tiny_lr}")
    return p


# Defaults of the options above for a real model and for --tiny (bundled data: 400 NQ-open, 300 GSM8K rows).
REAL = dict(train_samples=2000, replay_samples=256, eval_samples=256, max_length=512, steps=200, batch_size=8)
TINY = dict(train_samples=200, replay_samples=48, eval_samples=48, max_length=128, steps=60, batch_size=16)


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on ``--tiny``."""
    for key, value in (TINY if args.tiny else REAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lr is None:
        args.lr = args._lr[1] if args.tiny else args._lr[0]
    return args


@dataclass
class Run:
    """What every example starts from: its arguments, the loaded model and data, and the θ0 row of the table."""

    args: argparse.Namespace
    started: float
    model: nn.Module
    tokenizer: Any
    data: "Data"
    rows: dict[str, dict[str, float]]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def start(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> Run:
    """Parse the command line, create ``--output-dir``, load model + data and measure θ0."""
    args = finish_args(parser.parse_args(argv))
    started = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    model, tokenizer, data = load_model_and_tokenizer(args)
    rows = {"before fine-tuning (θ0)": measure(model, data, tokenizer.pad_token_id)}
    return Run(args, started, model, tokenizer, data, rows)


def lora_targets(args: argparse.Namespace) -> Any:
    """``--target-modules`` as ``LoraConfig`` takes it: the string ``"all-linear"`` or a list of names."""
    return args.target_modules[0] if args.target_modules == ["all-linear"] else args.target_modules


def janus_config(args: argparse.Namespace):
    """The :class:`hf_janus.JanusConfig` the command line describes."""
    from hf_janus import JanusConfig

    return JanusConfig(tau=args.tau, beta=args.beta, compression_rank=args.compression_rank or None,
                       max_steps=args.janus_max_steps,
                       replay_batch_size=args.replay_batch_size, seed=args.seed)


# ---- a tiny offline model ------------------------------------------------------------------------------------
def byte_tokenizer():
    """A byte-level fast tokenizer (every byte is a token, ``<s>`` prepended): any text, no files to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build_tiny_model(path: str, seed: int = 0) -> str:
    """Save a randomly initialized 2-layer Llama (hidden size 64) with :func:`byte_tokenizer` to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pretrain(model: nn.Module, samples: list[dict], steps: int, lr: float = 3e-3, batch_size: int = 16,
             seed: int = 0) -> None:
    """A few AdamW steps on every token of the past-task samples, so that the tiny model knows them."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    collate = Collator(pad_id=model.config.pad_token_id or 0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(samples), (min(batch_size, len(samples)),), generator=gen).tolist()
        batch = collate([{"input_ids": samples[i]["input_ids"], "labels": samples[i]["input_ids"]} for i in idx])
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


# ---- data ----------------------------------------------------------------------------------------------------
def _load(task: str, tiny: bool) -> Any:
    import datasets

    if tiny:
        path = resources.files("hf_janus").joinpath("data", BUNDLED[task])
        return datasets.load_dataset("json", data_files=str(path), split="train")
    name, config, split = PAST_TASK if task == "past" else NEW_TASK
    return datasets.load_dataset(name, config, split=split)


def encode(tokenizer: Any, prompt: str, answer: str, max_length: int) -> dict[str, list[int]]:
    """``prompt`` + ``answer`` + EOS, with ``labels`` only on the answer (prompt tokens are -100); a long
    prompt is cut from the left, never the answer."""
    a = tokenizer(answer, add_special_tokens=False)["input_ids"][: max_length // 2]
    if tokenizer.eos_token_id is not None:
        a = a + [tokenizer.eos_token_id]
    p = tokenizer(prompt)["input_ids"]
    p = p[-(max_length - len(a)):]
    ids = p + a
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * len(p) + a}


def qa_example(row: dict) -> tuple[str, str]:
    """An NQ-open row as (prompt, answer)."""
    answer = row["answer"][0] if isinstance(row["answer"], list) else row["answer"]
    return f"Q: {row['question']}?\nA:", f" {answer}"


def math_example(row: dict) -> tuple[str, str]:
    """A GSM8K row as (prompt, worked solution)."""
    return f"Question: {row['question']}\nAnswer:", f" {row['answer']}"


@dataclass
class Data:
    """Tokenized splits: ``replay`` and ``past_eval`` are disjoint parts of the past task."""

    train: list[dict]  # new task, fine-tuned on
    new_eval: list[dict]  # new task, held out
    replay: list[dict]  # past task, replayed by JANUS
    past_eval: list[dict]  # past task, never replayed


def load_data(args: argparse.Namespace, tokenizer: Any) -> Data:
    """Read both tasks (Hub or bundled excerpts), shuffle them with ``args.seed`` and tokenize them."""
    past, new = _load("past", args.tiny), _load("new", args.tiny)
    rng = random.Random(args.seed)
    past_idx, new_idx = list(range(len(past))), list(range(len(new)))
    rng.shuffle(past_idx)
    rng.shuffle(new_idx)
    m, e = args.replay_samples, args.eval_samples
    if m + e > len(past):
        raise SystemExit(f"--replay-samples + --eval-samples = {m + e} > {len(past)} past-task examples")
    n_train = min(args.train_samples, len(new) - e)
    if n_train < 1:
        raise SystemExit(f"--eval-samples {e} leaves no GSM8K example to train on ({len(new)} in all)")

    def enc(ds: Any, idx: list[int], fmt: Callable[[dict], tuple[str, str]]) -> list[dict]:
        return [encode(tokenizer, *fmt(ds[i]), args.max_length) for i in idx]

    return Data(train=enc(new, new_idx[:n_train], math_example), new_eval=enc(new, new_idx[-e:], math_example),
                replay=enc(past, past_idx[:m], qa_example), past_eval=enc(past, past_idx[m:m + e], qa_example))


class Collator:
    """Right-pads ``input_ids`` (with ``pad_id``), ``attention_mask`` (0) and ``labels`` (-100)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for r in rows:
            n = len(r["input_ids"])
            out["input_ids"].append(list(r["input_ids"]) + [self.pad_id] * (width - n))
            out["attention_mask"].append([1] * n + [0] * (width - n))
            out["labels"].append(list(r.get("labels", r["input_ids"])) + [-100] * (width - n))
        return {k: torch.tensor(v) for k, v in out.items()}


# ---- model ---------------------------------------------------------------------------------------------------
def load_model_and_tokenizer(args: argparse.Namespace,
                             data_hook: Optional[Callable] = None) -> tuple[nn.Module, Any, Data]:
    """The model to fine-tune, its tokenizer and the tokenized data.

    With ``--tiny`` a tiny Llama is built under ``OUTPUT/tiny-base``, pretrained briefly on the past task
    (replayed and held-out examples alike) and saved there, so that later ``--model OUTPUT/tiny-base`` works too.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model
    if args.tiny:
        path = build_tiny_model(os.path.join(args.output_dir, "tiny-base"), args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = load_data(args, tokenizer)
    dtype = torch.float32  # fp32 master weights: exact rectification; Trainer's bf16 autocast still applies
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if args.tiny:
        past = [{"input_ids": r["input_ids"]} for r in data.replay + data.past_eval]
        pretrain(model, past, steps=args.tiny_pretrain_steps, seed=args.seed)
        model.save_pretrained(path)
        args.model = path
    if torch.cuda.is_available():
        model.to("cuda")
    return model.eval(), tokenizer, data


def training_args(args: argparse.Namespace, **overrides: Any):
    """``TrainingArguments`` of a short fine-tuning run that saves nothing by itself (the script saves)."""
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        remove_unused_columns=False, disable_tqdm=args.tiny,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


@torch.no_grad()
def nll(model: nn.Module, samples: list[dict], pad_id: int, batch_size: int = 16) -> float:
    """Mean negative log-likelihood per labelled (answer) token."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    collate = Collator(pad_id)
    total, count = 0.0, 0
    for i in range(0, len(samples), batch_size):
        batch = {k: v.to(device) for k, v in collate(samples[i:i + batch_size]).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        labels = batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                           reduction="sum")
        total += float(loss)
        count += int((labels != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


def measure(model: nn.Module, data: Data, pad_id: int) -> dict[str, float]:
    """Past-task NLL on never-replayed examples, and new-task NLL on held-out examples."""
    return {"past_nll": nll(model, data.past_eval, pad_id), "new_nll": nll(model, data.new_eval, pad_id)}


def measure_at_train_end(data: Data, pad_id: int, rows: dict[str, dict[str, float]], name: str):
    """A ``TrainerCallback`` that measures the fine-tuned model before ``JanusCallback`` changes it (it must
    come *before* the JanusCallback in ``callbacks``: callbacks run in order)."""
    from transformers import TrainerCallback

    class MeasureAtTrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            rows[name] = measure(model, data, pad_id)

    return MeasureAtTrainEnd()


def print_table(rows: dict[str, dict[str, float]]) -> None:
    print("| model | past task NLL (NQ-open, not replayed) ↓ | new task NLL (GSM8K held out) ↓ |")
    print("|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {vals['past_nll']:.3f} | {vals['new_nll']:.3f} |")


def save_results(args: argparse.Namespace, rows: dict[str, dict[str, float]], report: Any, started: float,
                 **extra: Any) -> str:
    """Write ``OUTPUT/results.json``: the table, the replay losses and what was run."""
    out = {
        "model": args.model, "tiny": args.tiny, "table": rows, "replay_loss": dict(report.replay_loss),
        "janus_steps": len(report.steps), "jacobian_evals": report.num_jacobian_evals,
        "seconds": time.perf_counter() - started, **extra,
    }
    path = os.path.join(args.output_dir, "results.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    return path


def push_folder(folder: str, repo_id: str) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` (needs ``hf auth login`` or ``HF_TOKEN``)."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="JANUS-rectified fine-tune")
    return str(getattr(info, "commit_url", info))
