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
from merge_fixtures import save_base
from trainer_fixtures import FAST, make_trainer, pretrained_llama, replay_data

from hf_janus import JanusCallback, __version__, load_report
from hf_janus.demo import VOCAB
from hf_janus.publish.card import BLOCK_BEGIN, CARD_NAME, JANUS_TAGS
from hf_janus.publish.record_file import REPORT_NAME

ROOT = Path(__file__).resolve().parents[2]


def readme_snippet(marker: str) -> str:
    """The README's Python block that contains ``marker``, exactly as the README shows it."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one README Python block with {marker!r}, found {len(matching)}"
    return matching[0]


def check_published(folder: Path, report, replay_size: int = len(replay_data())) -> dict:
    """The folder holds the publication record of ``report`` and a card with the JANUS section; returns the
    record's JSON."""
    record = json.loads((folder / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["hf_janus_version"] == __version__ and record["kind"] == "full"
    published = load_report(str(folder))
    assert published.alphas == report.alphas and published.replay_loss == report.replay_loss
    assert published.replay is not None and published.replay.size == replay_size
    card = (folder / CARD_NAME).read_text(encoding="utf-8")
    assert BLOCK_BEGIN in card and all(tag in card for tag in JANUS_TAGS)
    assert "Intended use and limitations" in card
    moved = report.repair is not None and report.repair.chosen not in (None, "janus")
    assert ("The repair after it" in card) == moved
    return record


def _hub_with_the_readmes_ids(root: Path, hub) -> None:
    """The model and datasets the snippet names, on the local Hub: a tiny Llama with a character tokenizer under
    the model id, the package's GSM8K and NQ-open excerpts under the dataset ids (GSM8K's in its "main" config)."""
    from huggingface_hub import HfApi

    data = Path(__file__).resolve().parents[2] / "hf_janus" / "data"
    base = save_base(root / "base")
    api = HfApi()
    api.create_repo("HuggingFaceTB/SmolLM2-135M-Instruct")
    api.upload_folder(repo_id="HuggingFaceTB/SmolLM2-135M-Instruct", folder_path=base)
    gsm8k = "".join(line for line in (data / "gsm8k_train_300.jsonl").read_text().splitlines(True)[:24])
    configs = "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    for repo, files in (("openai/gsm8k", {"main/train.jsonl": gsm8k, "README.md": configs}),
                        ("google-research-datasets/nq_open",
                         {"train.jsonl": "".join((data / "nq_open_dev_400.jsonl").read_text().splitlines(True)[:24])})):
        api.create_repo(repo, repo_type="dataset")
        for path, text in files.items():
            api.upload_file(path_or_fileobj=text.encode(), path_in_repo=path, repo_id=repo, repo_type="dataset")


def test_the_readme_trainer_snippet_repairs_and_publishes(tmp_path, monkeypatch):
    """The README's Trainer snippet as written, against a local Hub that holds the model and datasets it names
    (tiny stand-ins), its training shortened: the callback runs JANUS and the repair after it on the Trainer's own
    samples, and push_to_hub publishes the weights with the record and the card."""
    import transformers
    from huggingface_hub import HfApi

    from hub_server import LocalHub, patch_hub_clients

    with LocalHub(token="hf_readme") as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
        _hub_with_the_readmes_ids(tmp_path, hub)
        real = transformers.TrainingArguments

        def short(output_dir, **kwargs):  # the snippet's run, a few steps long, in tmp_path
            return real(str(tmp_path / output_dir), **{**kwargs, "max_steps": 3, "per_device_train_batch_size": 4,
                                                       "report_to": [], "use_cpu": True, "disable_tqdm": True})

        monkeypatch.setattr(transformers, "TrainingArguments", short)
        namespace: dict = {}
        exec(compile(readme_snippet("JanusCallback("), "README.md (Trainer snippet)", "exec"), namespace)
        janus = namespace["janus"]
        assert janus.report.repair is not None and janus.report.repair.chosen is not None
        files = set(HfApi().list_repo_files(f"{HfApi().whoami()['name']}/smollm2-gsm8k"))
        assert {"model.safetensors", REPORT_NAME, CARD_NAME} <= files
        record = check_published(tmp_path / "smollm2-gsm8k", janus.report, replay_size=24)
        assert record["repair"]["steps"] == 128


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
