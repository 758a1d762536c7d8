"""Find a saved PEFT adapter (local directory or Hub repo) and its base model, and check they belong together.

Weights are read from safetensors files. An adapter or model whose weights exist only as a pickle
(``adapter_model.bin``, ``pytorch_model.bin``) is refused unless ``allow_pickle=True`` (:func:`pickle_refused`
says why and what to do); with it the pickle is read with torch's restricted unpickler (``weights_only=True``).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from hf_janus.adapters.peft_layers import is_mutating_init
from hf_janus.engine.layers import rule_for
from hf_janus.errors import JanusError, hub_error
from hf_janus.io_utils import hub_cache_snapshot, looks_like_local_path

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
SAFE_ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_ADAPTER_WEIGHTS = "adapter_model.bin"
ADAPTER_WEIGHT_NAMES = (SAFE_ADAPTER_WEIGHTS, PICKLED_ADAPTER_WEIGHTS)
# The weight files transformers' from_pretrained reads, in its order of preference.
SAFE_MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_MODEL_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
PEFT_PREFIX = "base_model.model."
DTypeLike = Union[str, torch.dtype, None]


@dataclass
class AdapterSource:
    """A saved adapter resolved to a local directory."""

    name: str  # as the user gave it: a Hub repo id or a local path
    path: str  # local directory holding adapter_config.json and the weights
    config: Any  # peft.PeftConfig
    revision: Optional[str] = None

    @property
    def peft_type(self) -> str:
        value = getattr(self.config, "peft_type", None)
        return str(getattr(value, "value", value))

    @property
    def init(self) -> Any:
        return getattr(self.config, "init_lora_weights", True)

    @property
    def mutating_init(self) -> Optional[str]:
        """The init that moved base weight into the adapter (``"pissa"``, ``"pissa_niter_4"``, ...), if any."""
        return self.init if is_mutating_init(self.init) else None

    @property
    def kind(self) -> str:
        """A short human-readable kind: ``lora``, ``dora``, ``pissa (unconverted)``, ``loha``, ..."""
        peft_type = self.peft_type.lower()
        if peft_type != "lora":
            return peft_type
        if getattr(self.config, "use_dora", False):
            return "dora"
        if self.mutating_init:
            return f"{self.mutating_init.lower()} (unconverted)"
        return "lora"



# ---- pickled weights -------------------------------------------------------------------------------------
def pickle_refused(what: str, name: str, filename: str, convert: str) -> JanusError:
    """The error for weights stored only as a pickle and read without ``allow_pickle``: the file, why it is
    refused, and the two ways out (``convert``: how to re-save it as safetensors)."""
    return JanusError(
        f"{what} {name!r} has its weights only as a pickle ({filename}), which is refused by default: unpickling a "
        f"file can run code hidden in it. Convert it to safetensors ({convert}), or, if you trust where it comes "
        "from, pass allow_pickle=True (--allow-pickle): it is then read with torch's restricted unpickler "
        "(torch.load(weights_only=True)), which loads tensors only and still refuses a pickle that would run code"
    )


def hub_has_file(repo_id: str, filename: str, revision: Optional[str],
                 token: Union[str, bool, None]) -> Optional[bool]:
    """Whether a Hub repo holds ``filename``, asked without downloading it (offline: whether the cache holds it).
    ``None`` when that cannot be told (unreachable Hub, gated repo): the load that follows then reports the real
    error. A repo or revision that does not exist reads as ``False``, as ``huggingface_hub.file_exists`` has it."""
    from huggingface_hub import constants, file_exists, try_to_load_from_cache

    try:
        if constants.HF_HUB_OFFLINE:
            return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
        return file_exists(repo_id, filename, revision=revision, token=token)
    except Exception as err:  # GatedRepoError, transport errors: left to the loader, which names them
        logger.debug("could not tell whether %s has %s: %s: %s", repo_id, filename, type(err).__name__, err)
        return None


def model_weights_format(base_model: Union[str, os.PathLike], revision: Optional[str] = None,
                         token: Union[str, bool, None] = None) -> tuple[str, Optional[str]]:
    """How a model (local directory or Hub repo) stores its weights, looked up without reading them:
    ``("safetensors", file)``, ``("pickle", file)`` when it has only ``pytorch_model.bin`` (or its index),
    ``("none", None)`` when it has neither, ``("unknown", None)`` when the Hub could not tell."""
    name = os.fspath(base_model)
    path = os.path.expanduser(name)
    unknown = False
    for kind, names in (("safetensors", SAFE_MODEL_WEIGHTS), ("pickle", PICKLED_MODEL_WEIGHTS)):
        for filename in names:
            found = (os.path.isfile(os.path.join(path, filename)) if os.path.isdir(path)
                     else hub_has_file(name, filename, revision, token))
            if found:
                return kind, filename
            unknown = unknown or found is None
    return ("unknown" if unknown else "none"), None


def _no_model_weights(name: str, revision: Optional[str], token: Union[str, bool, None]) -> Optional[JanusError]:
    """The error for a model with no weight file at all, or ``None`` when the Hub repo itself is missing or
    unreachable (``from_pretrained`` then names that). Raised here because ``from_pretrained`` with
    ``use_safetensors=True`` would otherwise ask the Hub's conversion service to convert the repo, sending the
    token to it."""
    from huggingface_hub import constants

    path = os.path.expanduser(name)
    local = os.path.isdir(path)
    has = ((lambda f: os.path.isfile(os.path.join(path, f))) if local
           else (lambda f: hub_has_file(name, f, revision, token)))
    if has(ADAPTER_CONFIG_NAME):
        return JanusError(f"{name!r} holds a PEFT adapter ({ADAPTER_CONFIG_NAME}), not a base model: pass it as the "
                          "adapter, and as base model the one the adapter was trained on")
    if not local and not has("config.json"):
        return None
    where = " in the local cache (HF_HUB_OFFLINE is set)" if not local and constants.HF_HUB_OFFLINE else ""
    looked = ", ".join(SAFE_MODEL_WEIGHTS + PICKLED_MODEL_WEIGHTS)
    return JanusError(f"base model {name!r}{f' at revision {revision!r}' if revision else ''} has no weights{where}: "
                      f"none of {looked}. Pass a folder written by save_pretrained, or a repo that holds them")


# ---- resolving and validating inputs ---------------------------------------------------------------------
def resolve_adapter(adapter: Union[str, os.PathLike], revision: Optional[str] = None,
                    token: Union[str, bool, None] = None, *, allow_pickle: bool = False) -> AdapterSource:
    """Find the adapter (local directory or Hub repo via ``snapshot_download``) and read its ``PeftConfig``.

    An adapter whose weights are only ``adapter_model.bin`` (a pickle) is refused unless ``allow_pickle``; with
    it, PEFT reads that file with ``torch.load(weights_only=True)``. From the Hub the pickle is only downloaded
    with ``allow_pickle``.
    """
    from peft import PeftConfig

    name = os.fspath(adapter)
    path = os.path.expanduser(name)
    from_hub = False
    if os.path.isdir(path):
        local = path
    elif os.path.exists(path):
        raise JanusError(f"adapter {name!r} is a file; pass the directory that holds {ADAPTER_CONFIG_NAME}")
    elif looks_like_local_path(name):
        raise JanusError(f"adapter directory {name!r} does not exist; pass an existing directory or a Hub repo id")
    else:
        from huggingface_hub import snapshot_download

        from_hub = True
        try:
            weights = ADAPTER_WEIGHT_NAMES if allow_pickle else (SAFE_ADAPTER_WEIGHTS,)
            local = snapshot_download(
                repo_id=name, revision=revision, token=token,
                allow_patterns=[ADAPTER_CONFIG_NAME, *weights, "README.md"],
            )
        except Exception as err:  # RepositoryNotFoundError, RevisionNotFoundError, offline, HTTP errors
            raise hub_error("fetch the adapter", name, err, revision=revision,
                            alternative="or pass a local directory") from err
    if not os.path.isfile(os.path.join(local, ADAPTER_CONFIG_NAME)):
        hint = ""
        if os.path.isfile(os.path.join(local, "config.json")):
            hint = " It holds a config.json: it looks like a full model, not an adapter (pass it as the base model)."
        raise JanusError(
            f"adapter {name!r} has no {ADAPTER_CONFIG_NAME}: it is not a PEFT adapter (save one with "
            f"peft_model.save_pretrained(dir)).{hint}"
        )
    if not os.path.isfile(os.path.join(local, SAFE_ADAPTER_WEIGHTS)) and not allow_pickle:
        # PEFT falls back to adapter_model.bin when there is no safetensors file
        if os.path.isfile(os.path.join(local, PICKLED_ADAPTER_WEIGHTS)):
            pickled: Optional[str] = os.path.join(local, PICKLED_ADAPTER_WEIGHTS)
        elif from_hub and hub_has_file(name, PICKLED_ADAPTER_WEIGHTS, revision, token):
            pickled = f"{PICKLED_ADAPTER_WEIGHTS} in the Hub repo"  # not downloaded above
        else:
            pickled = None
        if pickled is not None:
            raise pickle_refused("adapter", name, pickled, "load it with PEFT and save it with "
                                 "peft_model.save_pretrained(dir, safe_serialization=True)")
    if not any(os.path.isfile(os.path.join(local, w)) for w in ADAPTER_WEIGHT_NAMES):
        raise JanusError(
            f"adapter {name!r} has {ADAPTER_CONFIG_NAME} but no weights ({' or '.join(ADAPTER_WEIGHT_NAMES)}); "
            "the upload or copy is incomplete"
        )
    try:
        config = PeftConfig.from_pretrained(local)
    except Exception as err:
        raise JanusError(f"could not read {ADAPTER_CONFIG_NAME} of adapter {name!r}: {err}") from err
    return AdapterSource(name=name, path=local, config=config, revision=revision)


def _canonical_ids(name: str) -> set[str]:
    """Names under which a model reference may be known: itself, its real path, and the repo id of a Hub
    cache snapshot directory."""
    name = name.rstrip("/\\")
    out = {name, name.lower()}
    expanded = os.path.expanduser(name)
    if os.path.exists(expanded):
        real = os.path.realpath(expanded)
        out.add(real)
        snapshot = hub_cache_snapshot(expanded)
        if snapshot is not None and snapshot.repo_id is not None:
            out.update({snapshot.repo_id, snapshot.repo_id.lower()})
    return out


def check_base_matches(base_model: str, adapter: AdapterSource, allow_mismatch: bool = False) -> None:
    """Compare ``base_model`` with the adapter's ``base_model_name_or_path``; a mismatch is an error.

    Equal ids, the same local directory, or a Hub cache snapshot of the named repo count as a match.
    ``allow_mismatch`` turns the error into a warning (for a renamed copy or a mirror of the base); layer
    shapes are still checked when the adapter is loaded.
    """
    expected = getattr(adapter.config, "base_model_name_or_path", None)
    if not expected:
        logger.warning("adapter %r does not record its base model; cannot check that %r is the right one",
                       adapter.name, base_model)
        return
    if _canonical_ids(os.fspath(base_model)) & _canonical_ids(expected):
        return
    message = (
        f"adapter {adapter.name!r} was trained on base model {expected!r} (base_model_name_or_path in its "
        f"{ADAPTER_CONFIG_NAME}) but base_model={os.fspath(base_model)!r} was given"
    )
    if allow_mismatch:
        logger.warning("%s; continuing because allow_base_mismatch=True", message)
        return
    raise JanusError(
        f"{message}. Pass the base model the adapter was trained on, or allow_base_mismatch=True "
        f"(--allow-base-mismatch) if {os.fspath(base_model)!r} is a copy of {expected!r}"
    )


def resolve_dtype(dtype: DTypeLike) -> Union[torch.dtype, str, None]:
    """``"bfloat16"``/``"torch.float16"``/``torch.float32``/``"auto"``/``None`` -> what ``from_pretrained`` takes."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name == "auto":
        return "auto"
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise JanusError(f"torch_dtype {dtype!r} is invalid: use float32, bfloat16, float16 or auto")
    return value


def _takes_weights_only() -> bool:
    """Whether this transformers' ``from_pretrained`` has ``weights_only`` (older ones pass unknown keywords on to
    the model's constructor, which fails)."""
    import inspect

    from transformers import PreTrainedModel

    return "weights_only" in inspect.signature(PreTrainedModel.from_pretrained).parameters


def describe_quantization(config: Any) -> Optional[str]:
    """A ``from_pretrained`` quantization config in words, for the merge record (None: a full-precision base)."""
    if config is None:
        return None
    to_dict = getattr(config, "to_dict", None)
    fields = to_dict() if callable(to_dict) else dict(config)
    if fields.get("load_in_4bit"):
        double = ", double quantization" if fields.get("bnb_4bit_use_double_quant") else ""
        return (f"bitsandbytes 4-bit {fields.get('bnb_4bit_quant_type', 'fp4')}{double}, "
                f"{str(fields.get('bnb_4bit_compute_dtype', 'float32')).replace('torch.', '')} compute")
    if fields.get("load_in_8bit"):
        return "bitsandbytes 8-bit (LLM.int8)"
    return str(getattr(fields.get("quant_method"), "value", fields.get("quant_method", type(config).__name__)))


def load_base_model(base_model: Union[str, os.PathLike], revision: Optional[str] = None,
                    torch_dtype: DTypeLike = None, device: Union[str, torch.device, None] = None,
                    token: Union[str, bool, None] = None, quantization_config: Any = None, *,
                    allow_pickle: bool = False) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with errors that name the model and the fix.

    ``quantization_config`` (e.g. a ``BitsAndBytesConfig``) is passed on as ``from_pretrained`` takes it; the
    quantized model is then placed by ``device_map`` (``device``, else ``"auto"``) instead of moved after.

    Weights are read from safetensors files (``use_safetensors=True``). A model that has only pickled weights
    (``pytorch_model.bin``) is refused unless ``allow_pickle``; with it, transformers reads them with
    ``torch.load(weights_only=True)``.
    """
    from transformers import AutoModelForCausalLM

    name = os.fspath(base_model)
    path = os.path.expanduser(name)
    if not os.path.isdir(path) and looks_like_local_path(name):
        raise JanusError(f"base model directory {name!r} does not exist; pass an existing directory or a Hub repo id")
    weights_format, weights_file = model_weights_format(name, revision, token)
    if weights_format == "pickle":
        if not allow_pickle:
            where = os.path.join(path, weights_file) if os.path.isdir(path) else f"{weights_file} in the Hub repo"
            raise pickle_refused("base model", name, where, "load it with transformers and save it with "
                                 "model.save_pretrained(dir), which writes model.safetensors")
        logger.warning("base model %r has only pickled weights (%s): reading them with torch.load(weights_only=True) "
                       "because allow_pickle=True", name, weights_file)
    elif weights_format == "none":
        missing = _no_model_weights(name, revision, token)
        if missing is not None:
            raise missing
    # use_safetensors=True: a pickle next to the safetensors files is never read.
    kwargs: dict[str, Any] = {"use_safetensors": weights_format != "pickle"}
    if _takes_weights_only():
        kwargs["weights_only"] = True  # transformers' default, stated so that no change of default can unrestrict it
    if revision:
        kwargs["revision"] = revision
    if token is not None:
        kwargs["token"] = token
    dtype = resolve_dtype(torch_dtype)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = str(device) if device is not None else "auto"
        device = None  # quantized layers cannot be moved after loading
    try:
        model = AutoModelForCausalLM.from_pretrained(path if os.path.isdir(path) else name, **kwargs)
    except Exception as err:
        if os.path.isdir(path):
            raise JanusError(f"could not load the base model from {name!r}: {type(err).__name__}: {err}") from err
        raise hub_error("fetch the base model", name, err, revision=revision,
                        alternative="or pass a local directory") from err
    if device is not None:
        model.to(device)
    return model.eval()


# ---- shapes ----------------------------------------------------------------------------------------------
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")
_LORA_EMB_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?$")


def _layer_dims(module: nn.Module) -> Optional[tuple[int, int]]:
    """(d_out, d_in) of a linear-like layer, (num_embeddings, dim) of an embedding."""
    rule = rule_for(module)
    if rule is not None:
        return rule.matrix_shape(module)
    if isinstance(module, nn.Embedding):
        return int(module.num_embeddings), int(module.embedding_dim)
    return None


def check_adapter_shapes(model: nn.Module, weights: dict[str, Tensor], adapter: AdapterSource, base_name: str) -> None:
    """Check the adapter's LoRA-family factors against the base layers before PEFT loads them.

    Names the first layer that is missing from the base model or whose shape disagrees, with both shapes.
    """
    modules = dict(model.named_modules())
    seen: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, value in weights.items():
        match = _LORA_KEY.match(key) or _LORA_EMB_KEY.match(key)
        if match is None:
            continue
        module = match.group("module").removeprefix(PEFT_PREFIX)
        seen.setdefault(module, {})[match.group("part")] = tuple(value.shape)
    for module_name, parts in seen.items():
        module = modules.get(module_name)
        if module is None:
            raise JanusError(
                f"adapter {adapter.name!r} has weights for layer {module_name!r}, which base model {base_name!r} "
                f"does not have: the adapter was trained on a different architecture"
            )
        dims = _layer_dims(module)
        if dims is None:
            continue
        d_out, d_in = dims
        if "lora_A" in parts and "lora_B" in parts:
            (r_a, a_in), (b_out, r_b) = parts["lora_A"][:2], parts["lora_B"][:2]
            got = (b_out, a_in)
        elif "lora_embedding_A" in parts and "lora_embedding_B" in parts:
            (r_a, a_in), (b_out, r_b) = parts["lora_embedding_A"][:2], parts["lora_embedding_B"][:2]
            got = (a_in, b_out)
        else:
            continue
        if got != (d_out, d_in) or r_a != r_b:
            raise JanusError(
                f"adapter {adapter.name!r} does not fit base model {base_name!r} at layer {module_name!r}: the "
                f"adapter's factors imply a weight of shape (d_out, d_in)={got} (rank {r_a}/{r_b}) but the base "
                f"layer is {(d_out, d_in)}. Pass the base model the adapter was trained on"
            )
