"""The README's ``Trainer`` snippet, run as written, publishes what its comment promises: ``trainer.save_model()``
writes the rectified weights with ``janus_rectification.json`` (the publication record) and a model card, and the
callback's constructions (given in ``Trainer(callbacks=[...])``, added with ``add_callback``, or bound with
``trainer=``) all publish the same documents."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from testing_utils import build_tiny
from trainer_fixtures import FAST, collate, make_trainer, pretrained_llama, replay_data
from transformers import TrainingArguments

from hf_janus import JanusCallback, __version__, load_report
from hf_janus.demo import VOCAB, math_samples
from hf_janus.publish.card import BLOCK_BEGIN, CARD_NAME, JANUS_TAGS
from hf_janus.publish.record_file import REPORT_NAME

ROOT = Path(__file__).resolve().parents[2]


def readme_snippet(marker: str) -> str:
    """The README's Python block that contains ``marker``, exactly as the README shows it."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one README Python block with {marker!r}, found {len(matching)}"
    return matching[0]


def new_task_rows() -> list[dict[str, list[int]]]:
    """GSM8K rows of one length, so that Trainer's default collator (the snippet passes none) can stack them."""
    batch = collate(math_samples(0, 16, max_len=48))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return [{"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": lab.tolist()}
            for ids, mask, lab in zip(batch["input_ids"], batch["attention_mask"], labels)]


def check_published(folder: Path, report) -> dict:
    """The folder holds the publication record of ``report`` and a card with the JANUS section; returns the
    record's JSON."""
    record = json.loads((folder / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["hf_janus_version"] == __version__ and record["kind"] == "full"
    published = load_report(str(folder))
    assert published.alphas == report.alphas and published.replay_loss == report.replay_loss
    assert published.replay is not None and published.replay.size == len(replay_data())
    card = (folder / CARD_NAME).read_text(encoding="utf-8")
    assert BLOCK_BEGIN in card and all(tag in card for tag in JANUS_TAGS)
    return record


def test_the_readme_trainer_snippet_publishes_the_record_and_the_card(tmp_path):
    snippet = readme_snippet("JanusCallback(")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             seed=0)
    namespace = {"model": pretrained_llama(), "args": args, "new_task": new_task_rows(),
                 "replay": replay_data()}
    exec(compile(snippet, "README.md (Trainer snippet)", "exec"), namespace)

    janus, out = namespace["janus"], Path(args.output_dir)
    assert janus.report is not None and janus.report.replay_loss["rectified"] < janus.report.replay_loss["finetuned"]
    record = check_published(out, janus.report)
    assert (out / "model.safetensors").is_file()
    # the record left at train end and the one save_model wrote are one document (same created_at)
    assert record["created_at"] == load_report(str(out)).created_at


@pytest.mark.parametrize("construction", ["callbacks", "add_callback", "trainer="])
def test_every_construction_publishes_the_same_documents(tmp_path, construction):
    model = build_tiny("llama", vocab=VOCAB)
    if construction == "callbacks":
        janus = JanusCallback(replay_data(), FAST)
        trainer = make_trainer(tmp_path, model, [janus])
    else:
        trainer = make_trainer(tmp_path, model, [])
        janus = JanusCallback(replay_data(), FAST, trainer=trainer if construction == "trainer=" else None)
        trainer.add_callback(janus)
    trainer.train()
    # at train end, output_dir holds the publication record (not the bare engine report) before any save
    at_train_end = json.loads((tmp_path / "out" / REPORT_NAME).read_text(encoding="utf-8"))
    assert at_train_end["hf_janus_version"] == __version__
    trainer.save_model(str(tmp_path / "saved"))
    record = check_published(tmp_path / "saved", janus.report)
    assert record == at_train_end


def test_a_callback_that_cannot_find_its_trainer_says_so_and_still_writes_the_record(tmp_path, caplog):
    """Driven by hand (no Trainer up the stack, none given), the callback cannot wrap save_model: it says so at
    train end with the fix, and output_dir still gets the publication record, not the bare engine report."""
    model = pretrained_llama()
    trainer = make_trainer(tmp_path, model, [])
    janus = JanusCallback(replay_data(), FAST)
    args, state, control = trainer.args, trainer.state, trainer.control
    janus.on_train_begin(args, state, control, model=model)
    with torch.no_grad():  # a "fine-tune": θ̂ moves away from the snapshotted θ0
        for name, param in model.named_parameters():
            if name.endswith("q_proj.weight"):
                param.add_(0.05 * torch.randn_like(param))
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        janus.on_train_end(args, state, control, model=model)
    assert "could not find the Trainer" in caplog.text and "trainer=trainer" in caplog.text
    assert "write_publication_files" in caplog.text
    record = json.loads((tmp_path / "out" / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["hf_janus_version"] == __version__ and record["kind"] == "full"
    assert record["num_jacobian_evals"] == janus.report.num_jacobian_evals
