"""``hf-janus demo``: forgetting and its repair on a tiny model, on CPU, in a minute or two.

1. "Pretrain" a tiny Llama until it has memorized NQ-open question/answer pairs (the past task).
2. Fine-tune it on GSM8K worked solutions (the new task): it forgets the QA pairs.
3. Rectify with JANUS (:func:`hf_janus.rectify`), replaying a part of the memorized pairs, and measure both
   tasks again on pairs that were *not* replayed.
4. (unless ``lora=False``) Train a LoRA adapter on GSM8K from the same pretrained model instead, save base and
   adapter to disk, and rectify the saved adapter with :class:`hf_janus.JanusMerger`; the result is saved as
   a LoRA adapter of the same rank and reloaded with stock ``PeftModel.from_pretrained`` to be measured.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from hf_janus.engine.config import JanusConfig
from hf_janus.engine.rectifier import rectify
from hf_janus.engine.report import RectificationReport

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
    from hf_janus.replay.prepare import prepare_replay

    return prepare_replay(samples, len(samples))[0]


@torch.no_grad()
def answer_nll(model, samples: list[dict], batch_size: int = 32) -> float:
    """Mean per-token negative log-likelihood of the labelled (answer) tokens."""
    from hf_janus.engine.capture import replay_losses
    from hf_janus.replay.prepare import prepare_replay

    return replay_losses(model, prepare_replay(samples, batch_size)).loss


def train(model, samples: list[dict], steps: int, lr: float, batch_size: int, seed: int, desc: str,
          progress: bool = True) -> None:
    """Plain AdamW loop over the trainable parameters; a Trainer would do the same, this keeps the demo
    dependency-light and fast."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
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


LORA_RANK = 8
# A gentler learning rate than the full fine-tuning: it still makes the tiny model forget the QA pairs, and the
# rectification's step count grows with the update's length: at twice this rate the loop took about twice the steps
# and ran into max_steps on some CPUs.
LORA_LR = 2.5e-4


@dataclass
class DemoResult:
    """What :func:`run_demo` measured.

    ``table`` maps a model name to ``{"past_nll", "new_nll"}`` (held-out answer NLL of the past task and of the
    new task); the first three rows are the full fine-tuning story, the ``LoRA ...`` rows (if any) the adapter
    story. ``report`` is the full fine-tuning rectification, ``lora_report`` the adapter's (``None`` without
    the LoRA part), ``seconds`` the wall time of the whole demo and ``phase_seconds`` that of each part.
    """

    table: dict[str, dict[str, float]]
    report: RectificationReport
    seconds: float
    lora_report: Optional[RectificationReport] = None
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def markdown(self) -> str:
        rows = ["| model | past task NLL (QA, not replayed) ↓ | new task NLL (GSM8K held out) ↓ |", "|---|---|---|"]
        for name, vals in self.table.items():
            rows.append(f"| {name} | {vals['past_nll']:.3f} | {vals['new_nll']:.3f} |")
        return "\n".join(rows)


def _measure(model, held_out: list[dict], math_test: list[dict]) -> dict[str, float]:
    return {"past_nll": answer_nll(model, held_out), "new_nll": answer_nll(model, math_test)}


def _lora_story(pretrained: dict, replay: list[dict], held_out: list[dict], math_train: list[dict],
                math_test: list[dict], steps: int, config: JanusConfig, seed: int, progress: bool,
                say: Callable[[str], None]) -> tuple[dict[str, dict[str, float]], RectificationReport]:
    """Train a LoRA adapter on the new task, rectify the *saved* adapter with JanusMerger, reload, measure."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_janus.adapters.saved.merger import JanusMerger

    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hf-janus-demo-") as tmp:
        base_dir, adapter_dir, rect_dir = (os.path.join(tmp, n) for n in ("base", "adapter", "adapter-rect"))
        base = tiny_llama(seed)
        base.load_state_dict(pretrained)
        base.save_pretrained(base_dir)

        torch.manual_seed(seed + 2)
        lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear", lora_dropout=0.0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, use_safetensors=True), lora)
        say(f"LoRA: training a rank-{LORA_RANK} adapter on GSM8K from the same pretrained model")
        train(model, math_train, steps, LORA_LR, 16, seed + 3, "LoRA fine-tuning on GSM8K", progress)
        rows[f"LoRA r={LORA_RANK} fine-tuned"] = _measure(model, held_out, math_test)
        model.save_pretrained(adapter_dir)

        say("LoRA: rectifying the saved adapter with JanusMerger (base and adapter read from disk)")
        delta = JanusMerger(base_dir, adapter_dir, replay, config, progress=progress).run()
        delta.model.eval()
        rows["LoRA + JANUS (merged weights)"] = _measure(delta.model, held_out, math_test)
        delta.save_adapter(rect_dir, adapter_rank="same", progress=progress)
        reloaded_base = AutoModelForCausalLM.from_pretrained(base_dir, use_safetensors=True)
        reloaded = PeftModel.from_pretrained(reloaded_base, rect_dir).eval()
        rows[f"LoRA + JANUS (saved as r={LORA_RANK} adapter)"] = _measure(reloaded, held_out, math_test)
        report = delta.report.rectification
    return rows, report


def run_demo(seed: int = 0, quick: bool = False, progress: bool = True, config: Optional[JanusConfig] = None,
             lora: bool = True, say: Optional[Callable[[str], None]] = None) -> DemoResult:
    """Run the whole story and return the before/after table and the rectification report(s).

    Args:
        seed: seed of the model init, the data order and JANUS.
        quick: fewer samples and steps (a smoke test; the effect is smaller).
        progress: show progress bars.
        config: :class:`JanusConfig` of both rectifications (default: r=32, all replay in one batch).
        lora: also tell the LoRA story (train an adapter, rectify it with :class:`JanusMerger`).
        say: called with one line of narration before each phase (e.g. ``print``); silent by default.
    """
    say = say or (lambda line: None)
    start = time.perf_counter()
    phases: dict[str, float] = {}
    n_qa, n_replay = (48, 24) if quick else (96, 48)
    pretrain_steps, finetune_steps = (150, 40) if quick else (300, 100)
    qa = qa_samples(n_qa)
    replay, held_out = full_text(qa[:n_replay]), qa[n_replay:]
    math_train, math_test = math_samples(0, 200), math_samples(200, 40)

    say(f"pretraining a tiny Llama on {n_qa} NQ-open question/answer pairs (the past task)")
    model = tiny_llama(seed)
    train(model, full_text(qa), pretrain_steps, 3e-3, 32, seed, "pretraining on NQ-open QA", progress)
    pretrained = copy.deepcopy(model.state_dict())
    table = {"pretrained θ0": _measure(model, held_out, math_test)}
    phases["pretrain"] = time.perf_counter() - start

    t0 = time.perf_counter()
    say("full fine-tuning on GSM8K worked solutions (the new task)")
    train(model, math_train, finetune_steps, 1e-3, 16, seed + 1, "fine-tuning on GSM8K", progress)
    table["fine-tuned θ̂"] = _measure(model, held_out, math_test)

    config = config or JanusConfig(compression_rank=32, replay_batch_size=48)
    say(f"rectifying with JANUS (τ={config.tau}, r={config.compression_rank}), replaying {n_replay} of the QA pairs")
    report = rectify(model, pretrained, replay, config, progress=progress)
    table["JANUS-rectified"] = _measure(model, held_out, math_test)
    phases["full fine-tuning"] = time.perf_counter() - t0

    lora_report = None
    if lora:
        t0 = time.perf_counter()
        rows, lora_report = _lora_story(pretrained, replay, held_out, math_train, math_test, finetune_steps,
                                        config, seed, progress, say)
        table.update(rows)
        phases["LoRA"] = time.perf_counter() - t0
    return DemoResult(table=table, report=report, seconds=time.perf_counter() - start, lora_report=lora_report,
                      phase_seconds=phases)


def _silence_library_progress() -> None:
    """transformers' own bars (loading/saving weights) would interleave with the demo's, and peft's
    ``get_peft_model`` reads a property transformers 5 deprecated: a warning the demo's reader can do nothing about."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - an older transformers without the switch
        pass


def run_cli(args) -> int:
    """``hf-janus demo``: run :func:`run_demo` as the command line says, narrate it and print the results."""
    from tqdm.auto import tqdm

    config = JanusConfig(tau=args.tau, compression_rank=args.compression_rank, replay_batch_size=48, seed=args.seed,
                         step_control=args.step_control, max_evaluations=args.max_evaluations or None)
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    _silence_library_progress()
    write = print if args.no_progress else tqdm.write  # keep the narration above the progress bars
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run_demo(seed=args.seed, quick=args.quick, progress=not args.no_progress, config=config,
                          lora=not getattr(args, "no_lora", False), say=lambda line: write(f"» {line}"))
    finally:  # a caller in the same process (a test, a notebook) keeps its own setting
        torch.set_num_threads(threads)
    print()
    print(result.markdown())
    print("\nPast-task figures are measured on QA pairs JANUS never replayed; lower is better.")
    print("\nFull fine-tuning, " + result.report.summary())
    if result.lora_report is not None:
        print("\nLoRA adapter (JanusMerger), " + result.lora_report.summary())
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in result.phase_seconds.items())
    print(f"\ndemo finished in {result.seconds:.1f}s ({phases})")
    if args.report:
        result.report.save(args.report)
        print(f"report written to {args.report}")
    unconverged = [name for name, report in (("full fine-tuning", result.report), ("LoRA", result.lora_report))
                   if report is not None and not report.converged]
    if unconverged and getattr(args, "require_converged", False):
        print(f"hf-janus demo: the {' and the '.join(unconverged)} rectification did not converge",
              file=sys.stderr)
        return 1
    return 0
