"""``JanusMerger`` / ``hf-janus merge`` with the repair after JANUS: ``--new-task-samples`` (what the adapter was
trained on) gives the gain it keeps, the output stays an adapter, and without them the JANUS point is kept and the
record has no repair."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from merge_fixtures import VOCAB, save_base, text_rows, train_adapter, write_jsonl

from hf_janus.cli import main
from hf_janus.publish.record_file import REPORT_NAME

FAST = ["--tau", "0", "--compression-rank", "0", "--no-progress"]
REPAIR = ["--distill-steps", "4", "--distill-lr", "0.01", "--keep-gain", "0.05"]


def _adapter_training_rows(seed: int = 0) -> list[dict]:
    """What :func:`merge_fixtures.train_adapter` trains on (twice over: the repair holds out every eighth)."""
    gen = torch.Generator().manual_seed(seed + 7)
    data = torch.randint(0, VOCAB, (6, 10), generator=gen).tolist()
    return [{"input_ids": row, "labels": row} for row in data] * 2


def _saved_inputs(tmp_path) -> tuple[str, str, str, str]:
    """A tiny base, a LoRA trained on it, a replay file and the adapter's training samples as a file."""
    base = save_base(tmp_path / "base")
    lora = train_adapter(base, tmp_path / "lora", "lora", steps=20, lr=5e-2)
    replay = write_jsonl(tmp_path / "replay.jsonl", text_rows(16))
    new_task = write_jsonl(tmp_path / "new_task.jsonl", _adapter_training_rows())
    return base, lora, replay, new_task


def test_merge_repairs_with_the_adapters_training_samples_and_writes_an_adapter(tmp_path, caplog):
    base, lora, replay, new_task = _saved_inputs(tmp_path)

    out = tmp_path / "repaired"
    assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--new-task-samples", new_task,
                 "--output", str(out), *REPAIR, *FAST]) == 0
    record = json.loads((out / REPORT_NAME).read_text())
    assert record["repair"]["steps"] == 4 and record["repair"]["validation_samples"]["new_task"] == 1
    assert os.path.exists(out / "adapter_config.json")
    assert "repair after JANUS" in (out / "README.md").read_text()

    out = tmp_path / "without"
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--output", str(out), *REPAIR,
                     *FAST]) == 0
    skipped = json.loads((out / REPORT_NAME).read_text())["repair"]
    assert skipped["chosen"] is None and "no new-task samples" in skipped["reason"]
    assert "repair after JANUS" in (out / "README.md").read_text()  # the card says what was done instead
    assert "no new-task samples" in caplog.text


def test_merge_repairs_a_qlora_adapter_by_training_the_dense_stand_ins(tmp_path):
    """On a 4-bit base the effective weights are dense stand-ins of the quantized layers: the repair trains them
    (the distilled point moves away from the JANUS point) and the output is an adapter on the quantized base."""
    pytest.importorskip("bitsandbytes")
    base, lora, replay, new_task = _saved_inputs(tmp_path)
    out = tmp_path / "repaired"
    assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--new-task-samples", new_task,
                 "--output", str(out), "--load-in-4bit", *REPAIR, *FAST]) == 0
    validation = json.loads((out / REPORT_NAME).read_text())["repair"]["validation"]
    assert validation["trained"]["new_task_loss"] != validation["janus"]["new_task_loss"]
    assert os.path.exists(out / "adapter_config.json")
