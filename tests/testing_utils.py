"""What the tests share: tiny causal LMs built from configs (no network), a toy fine-tune, replay data, and a
failure injected into the rectifier's captures. Imported as ``testing_utils`` (``tests`` is on pytest's
``pythonpath``); fixtures stay in ``conftest.py``."""

from __future__ import annotations

import copy

import torch

VOCAB = 48


def build_tiny(family: str, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """A 2-layer model of the given family, small enough for explicit per-sample Jacobians."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0))
    else:  # pragma: no cover
        raise ValueError(family)
    return model.eval()


def random_replay(n: int, seed: int = 1, vocab: int = VOCAB, min_len: int = 4, max_len: int = 12) -> list[dict]:
    """Samples of varied lengths, so batches carry padding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * length})
    return out


def fine_tune(model: torch.nn.Module, steps: int = 15, lr: float = 5e-3, seed: int = 2, vocab: int = VOCAB):
    """A few AdamW steps on a different 'task' (random sequences): returns θ0's state dict."""
    reference = copy.deepcopy(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    train_steps(model, torch.randint(0, vocab, (8, 10), generator=gen), steps, lr)
    return reference


def train_steps(model: torch.nn.Module, data: torch.Tensor, steps: int, lr: float) -> float:
    """``steps`` AdamW steps of ``model`` (what requires grad) on ``data`` as its own labels, in train mode, left in
    eval mode; the last loss."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return float(loss.detach())


def fine_tune_samples(seed: int = 2, vocab: int = VOCAB) -> list[dict]:
    """What :func:`fine_tune` trains on, as labelled samples (16: the 8 sequences twice), for the repair after JANUS,
    which holds out every eighth."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (8, 10), generator=gen)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in data] * 2


#: a rectification with the repair after JANUS, small enough for tests: on these tiny models the distillation gives
#: back replay NLL for most of the gain, so a small keep_gain lets it choose a point on the line toward θ0
REPAIR_CONFIG = dict(compression_rank=4, replay_batch_size=4, tau=0.9, distill_steps=12, distill_lr=1e-2,
                     keep_gain=0.05,
                     new_task_batch_size=4)


def fail_capture(at: int, exc: BaseException):
    """Hooks for ``Rectifier(..., observer=)`` that make the run's ``at``-th Jacobian capture raise ``exc`` (a
    failure in the middle of a run)."""
    from hf_janus.engine.observer import RunObserver

    class FailingCapture(RunObserver):
        calls = 0

        def capturing(self, tag):
            self.calls += 1
            if self.calls == at:
                raise exc

    return FailingCapture()



def held_out(model, replay, new_task, replay_batch_size: int, new_task_batch_size: int, split: bool = True):
    """The repair's held-out figures computed apart from the engine (every eighth sample in the order the engine
    batches them): the new task's loss, the replay's NLL and its token agreement, of the point ``model`` holds."""
    import torch.nn.functional as F

    from hf_janus.engine.repair import NEW_TASK_VALIDATION_MAX, split_validation
    from hf_janus.replay.prepare import IGNORE_INDEX, loss_targets, prepare_replay

    def nll(samples, agreement=False):
        total = tokens = agree = 0
        for batch in samples:
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            targets = loss_targets(batch)
            counted = targets != IGNORE_INDEX
            total += float(F.cross_entropy(logits[counted].float(), targets[counted], reduction="sum"))
            agree += int((logits[counted].argmax(-1) == targets[counted]).sum())
            tokens += int(counted.sum())
        return (total / tokens, agree / tokens) if agreement else total / tokens

    _, replay_held = split_validation(prepare_replay(replay, replay_batch_size))
    new_batches = prepare_replay(new_task, new_task_batch_size, group_by_length=False)
    new_held = split_validation(new_batches, NEW_TASK_VALIDATION_MAX)[1] if split else new_batches
    return nll(new_held), *nll(replay_held, agreement=True)


def trained_lora(**lora_kwargs):
    """A LoRA fine-tuned on the new task (the samples of :func:`fine_tune_samples`), and its state at train begin."""
    from peft import LoraConfig, get_peft_model

    from hf_janus.adapters.peft_layers import adapted_linear_layers, initial_state
    from hf_janus.replay.prepare import prepare_replay

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                        **lora_kwargs)
    model = get_peft_model(build_tiny("llama"), config)
    initial = initial_state(adapted_linear_layers(model))
    batch = prepare_replay(fine_tune_samples(), 16)[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    for _ in range(20):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), initial
