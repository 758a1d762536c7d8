"""The example scripts under ``examples/`` run end to end with ``--tiny`` (a tiny local Llama, the bundled data,
no network), and the configuration reference (docs/reference/configuration.md) documents every ``JanusConfig``
field."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_janus import JanusConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# As small as the story allows: a few seconds of work per script once torch is imported.
TINY = ["--tiny", "--tiny-pretrain-steps", "80", "--train-samples", "64", "--replay-samples", "16",
        "--eval-samples", "16", "--max-length", "96", "--steps", "20", "--janus-max-steps", "8",
        "--replay-batch-size", "16"]


def run_example(name: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *TINY, "--output-dir", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "| model |" in proc.stdout and "JANUS rectification:" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["tiny"] is True and results["jacobian_evals"] >= 2
    loss = results["replay_loss"]
    # The fine-tuning made the replayed past task worse, and JANUS gave part of it back.
    assert loss["finetuned"] > loss["reference"]
    assert loss["rectified"] < loss["finetuned"]
    assert (out / "janus_rectification.json").is_file()
    return results


@pytest.mark.slow
def test_finetune_full(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    results = run_example("finetune_full.py", out)
    assert list(results["table"]) == ["before fine-tuning (θ0)", "fine-tuned (θ̂)", "JANUS-rectified"]
    model = AutoModelForCausalLM.from_pretrained(out)  # the saved, rectified model loads
    assert model.config.num_hidden_layers == 2
    assert (out / "tokenizer.json").is_file()


@pytest.mark.slow
def test_finetune_lora_callback_and_merger(tmp_path):
    out = tmp_path / "lora"
    results = run_example("finetune_lora.py", out, "--lora-rank", "4")
    assert set(results["table"]) == {"before fine-tuning (θ0)", "LoRA r=4 fine-tuned", "+ JanusCallback (adapter)",
                                     "+ JanusMerger (adapter)"}
    for sub in ("adapter", "adapter-rectified", "adapter-merger-rectified"):
        config = json.loads((out / sub / "adapter_config.json").read_text())
        assert config["r"] == 4 and (out / sub / "adapter_model.safetensors").is_file()
    merger = results["merger_replay_loss"]
    assert merger["rectified"] < merger["finetuned"]


@pytest.mark.slow
def test_finetune_qlora_callback_and_merger(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "qlora"
    results = run_example("finetune_lora.py", out, "--lora-rank", "4", "--load-in-4bit")
    assert "QLoRA r=4 fine-tuned" in results["table"]
    merger = results["merger_replay_loss"]
    assert merger["rectified"] < merger["finetuned"]
    for sub in ("adapter-rectified", "adapter-merger-rectified"):
        assert (out / sub / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_finetune_pissa(tmp_path):
    out = tmp_path / "pissa"
    results = run_example("finetune_pissa.py", out, "--lora-rank", "4")
    table = results["table"]
    # The reloaded PiSSA adapter and its conversion to a plain LoRA both give the in-memory rectified model.
    for name in ("+ JanusCallback, reloaded PiSSA", "+ JanusCallback, reloaded as LoRA"):
        for key in ("past_nll", "new_nll"):
            assert table[name][key] == pytest.approx(table["+ JanusCallback (in memory)"][key], abs=2e-3)
    converted = json.loads((out / "adapter-rectified-lora" / "adapter_config.json").read_text())
    assert converted["r"] == 8  # a rank-r PiSSA adapter converts to a rank-2r LoRA of the original base


def test_docs_document_every_config_field():
    """The configuration reference (moved out of the README by issue 32; written by
    docs/generate_config_reference.py, whose staleness tests/cli/test_docs.py checks) has a row per field."""
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text(encoding="utf-8")
    janus_table = page.split("## `ReplayOptions`")[0]  # JanusConfig's rows only, not ReplayOptions' below them
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", janus_table, flags=re.M))
    for field in dataclasses.fields(JanusConfig):
        assert field.name in rows, f"JanusConfig.{field.name} is missing from docs/reference/configuration.md"
    defaults = JanusConfig()
    for name in ("tau", "beta", "compression_rank", "replay_batch_size", "max_steps", "min_alpha", "gram_rcond",
                 "seed"):
        assert float(rows[name]) == getattr(defaults, name), name
