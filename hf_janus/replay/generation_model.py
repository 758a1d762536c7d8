"""What θ0 must be and have to answer prompts (:class:`~hf_janus.replay.self_replay.SelfReplay`): a tokenizer, a
generative model with a generation config, its end-of-sequence tokens, and room in its context for each answer."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from hf_janus.errors import JanusError


def require_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer``, or a refusal when there is none: prompts are text and θ0's answers are read as tokens."""
    if tokenizer is None:
        raise JanusError("self-replay needs θ0's tokenizer to turn the prompts into tokens: give the Trainer "
                         "processing_class=tokenizer, save the tokenizer next to the base model, or pass "
                         "SelfReplay(tokenizer=...)")
    if not callable(tokenizer):
        raise JanusError(f"self-replay's tokenizer is a {type(tokenizer).__name__}, which cannot tokenize text; pass "
                         "the model's tokenizer (AutoTokenizer.from_pretrained)")
    return tokenizer


def generative_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (whose ``generate`` forwards to it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner


def check_generative(model: nn.Module) -> None:
    """Refuse a model that cannot generate text: no ``generate``, no generation config, or an architecture that
    transformers says cannot generate (an encoder such as ``BertModel``)."""
    inner = generative_model(model)
    can_generate = getattr(inner, "can_generate", None)
    if not hasattr(model, "generate") or not callable(can_generate) or not can_generate():
        raise JanusError(f"self-replay needs θ0 to generate text, but {type(inner).__name__} is not a generative "
                         "model (an encoder-only or headless model): load it with AutoModelForCausalLM, or give "
                         "replay data of the past task instead of SelfReplay")
    if getattr(inner, "generation_config", None) is None:
        raise JanusError(f"self-replay needs θ0's generation config, and {type(inner).__name__} has none: set "
                         "model.generation_config = GenerationConfig.from_model_config(model.config)")


def eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    found: list[int] = []
    for value in (generative_model(model).generation_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        for token in (value if isinstance(value, (list, tuple)) else [value]):
            if token is not None and int(token) not in found:
                found.append(int(token))
    return found


def context_length(model: nn.Module) -> Optional[int]:
    """The longest sequence θ0 takes: its config's position limit, where it has one."""
    config = getattr(generative_model(model), "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(model: nn.Module, rows: list[list[int]], max_new_tokens: int) -> None:
    """Refuse, before generating, a prompt whose answer would run past θ0's context."""
    context = context_length(model)
    if context is None:
        return
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    if len(rows[longest]) + max_new_tokens > context:
        raise JanusError(f"self-replay prompt {longest} has {len(rows[longest])} tokens, and with max_new_tokens="
                         f"{max_new_tokens} its answer would run past θ0's context of {context} tokens: lower "
                         "SelfReplay(max_new_tokens=...) or shorten the prompt")
