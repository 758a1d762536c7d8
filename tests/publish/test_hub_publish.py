"""Publishing rectified outputs with their JANUS record (issue 4), against the local fake Hub.

The real huggingface_hub / transformers / peft / datasets clients talk to ``hub_server.LocalHub`` in-process
(``patch_hub_clients``). A tiny base model, a LoRA adapter trained on it and a jsonl replay dataset are
uploaded once per module; ``JanusMerger`` then works from their repo ids, exactly as with huggingface.co.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time

import pytest
import torch
from testing_utils import random_replay
from hub_server import LocalHub, patch_hub_clients
from merge_fixtures import IDS, fast_config, logits, save_base, text_rows, train_adapter

from hf_janus import JanusError, JanusMerger, MergeReport, RectificationReport, load_report, rectify
from hf_janus.integrations.trainer_publish import install_trainer_hooks
from hf_janus.engine.report import REFERENCE_JACOBIAN
from hf_janus.publish.card import BLOCK_BEGIN, JANUS_TAGS
from hf_janus.publish.files import write_publication_files
from hf_janus.publish.hub import push_folder
from hf_janus.publish.record_file import REPORT_NAME, SCHEMA_VERSION, PublishedReport
from hf_janus.publish.weights_meta import add_safetensors_metadata, read_safetensors_metadata

TOKEN = "hf_publish_test_token"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A token-protected hub holding the base model, its adapter and the past task's data; the clients of
    this process point at it for the whole module."""
    root = tmp_path_factory.mktemp("publish")
    base = save_base(root / "base")
    adapter = train_adapter(base, root / "lora", "lora", base_name="me/tiny-base")
    payload = "".join(json.dumps(r) + "\n" for r in text_rows(6)).encode()
    with LocalHub(token=TOKEN) as local_hub, patch_hub_clients(local_hub, root / "hf_home"):
        from huggingface_hub import HfApi

        api = HfApi()
        for repo, folder in (("me/tiny-base", base), ("me/tiny-lora", adapter)):
            api.create_repo(repo)
            api.upload_folder(repo_id=repo, folder_path=folder)
        api.create_repo("me/past-task", repo_type="dataset")
        api.upload_file(path_or_fileobj=payload, path_in_repo="data/train.jsonl", repo_id="me/past-task",
                        repo_type="dataset")
        yield local_hub


@pytest.fixture(scope="module")
def delta(hub):
    return JanusMerger("me/tiny-base", "me/tiny-lora", "me/past-task:train", fast_config(), progress=False).run()


def head(hub, repo_id, repo_type="model"):
    return hub.list_commits(repo_id, repo_type=repo_type)[0].oid


def hub_base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained("me/tiny-base").eval()


def folder_bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


# ---- merger outputs ---------------------------------------------------------------------------------------
def test_push_adapter_loads_back_identically_with_its_record(hub, delta, tmp_path):
    from huggingface_hub import HfApi, hf_hub_download
    from peft import PeftModel

    local = delta.save_adapter(tmp_path / "local", adapter_rank=10_000, progress=False)
    commit = delta.push_to_hub("me/janus-adapter", format="adapter", adapter_rank=10_000, progress=False)
    assert commit.oid == head(hub, "me/janus-adapter") and "me/janus-adapter" in commit

    from_hub = PeftModel.from_pretrained(hub_base(), "me/janus-adapter").eval()
    from_disk = PeftModel.from_pretrained(hub_base(), local).eval()
    assert torch.equal(logits(from_hub, IDS), logits(from_disk, IDS))
    # The adapter computes W x + B (A x) where the merged model computes (W + ΔW_rect) x: another float32 evaluation
    # of the same function, as far from the float64 logits as the merged model's own float32 evaluation, give or
    # take (10x, as in tests/real/test_real_model_rectify.py).
    reference = logits(copy.deepcopy(delta.model).double(), IDS)
    float32_error = float((logits(delta.model, IDS).double() - reference).abs().max())
    adapter_error = float((logits(from_hub, IDS).double() - reference).abs().max())
    assert adapter_error <= 10 * float32_error, (adapter_error, float32_error)

    info = HfApi().model_info("me/janus-adapter")
    assert set(JANUS_TAGS) | {"peft"} <= set(info.tags)
    card = info.card_data
    assert (card.base_model, card.library_name, card.datasets) == ("me/tiny-base", "peft", ["me/past-task"])

    report = load_report("me/janus-adapter")
    assert (report.kind, report.schema_version, report.commit) == ("adapter", SCHEMA_VERSION, commit.oid)
    assert (report.base_model.id, report.base_model.sha) == ("me/tiny-base", head(hub, "me/tiny-base"))
    assert (report.adapter.id, report.adapter.sha, report.adapter.kind) == ("me/tiny-lora", head(hub, "me/tiny-lora"),
                                                                           "lora")
    replay = report.replay
    assert (replay.id, replay.split, replay.size, replay.local) == ("me/past-task", "train", 6, False)
    assert replay.sha == head(hub, "me/past-task", "dataset") and replay.fingerprint
    rect = delta.report.rectification
    assert report.alphas == rect.alphas and report.replay_loss == rect.replay_loss
    assert [layer.name for layer in report.rectification.layers] == [layer.name for layer in rect.layers]
    assert report.config == rect.config and set(report.rectification.timings) == set(rect.timings)
    assert report.merge["refactorization"]["adapter_rank"] == 10_000
    merge_report = MergeReport.load(hf_hub_download("me/janus-adapter", REPORT_NAME))
    assert (merge_report.adapter, merge_report.output_format) == ("me/tiny-lora", "adapter")
    assert merge_report.rectified_layers == delta.report.rectified_layers

    weights = hf_hub_download("me/janus-adapter", "adapter_model.safetensors")
    meta = read_safetensors_metadata(weights)
    assert meta["format"] == "pt" and meta["janus.base_model_sha"] == report.base_model.sha
    assert json.loads(meta["janus.config"])["tau"] == rect.config["tau"]
    assert json.loads(meta["janus.alphas"]) == pytest.approx(rect.alphas)
    assert meta["janus.replay_fingerprint"] == replay.fingerprint

    text = open(hf_hub_download("me/janus-adapter", "README.md"), encoding="utf-8").read()
    assert 'PeftModel.from_pretrained(base, "me/janus-adapter")' in text  # the pushed card names the repo
    assert 'from_pretrained("me/tiny-base")' in text
    assert f"| acceptance threshold τ | {rect.config['tau']:g} |" in text
    assert f"| {rect.replay_loss['reference']:.4f} | {rect.replay_loss['finetuned']:.4f} |" in text
    # the local copy keeps a card that loads from where it lies
    assert f'PeftModel.from_pretrained(base, "{tmp_path / "local"}")' in open(os.path.join(local, "README.md")).read()


def test_push_full_twice_makes_two_commits_and_old_revisions_stay_readable(hub, delta):
    from huggingface_hub import HfApi, hf_hub_download
    from transformers import AutoModelForCausalLM

    api = HfApi()
    first = delta.push_to_hub("me/janus-full", format="full", commit_message="first")
    loaded = AutoModelForCausalLM.from_pretrained("me/janus-full").eval()
    assert torch.equal(logits(loaded, IDS), logits(delta.model, IDS))
    info = api.model_info("me/janus-full")
    assert set(JANUS_TAGS) | {"transformers"} <= set(info.tags)
    assert (info.card_data.base_model, info.card_data.pipeline_tag) == ("me/tiny-base", "text-generation")
    assert read_safetensors_metadata(hf_hub_download("me/janus-full", "model.safetensors"))["janus.kind"] == "full"

    second = delta.push_to_hub("me/janus-full", format="full", commit_message="second")
    commits = api.list_repo_commits("me/janus-full")
    assert [c.commit_id for c in commits[:2]] == [second.oid, first.oid] and second.oid != first.oid
    assert [c.title for c in commits[:2]] == ["second", "first"]
    assert load_report("me/janus-full").commit == second.oid
    assert load_report("me/janus-full", revision=first.oid).commit == first.oid

    branch = delta.push_to_hub("me/janus-full", format="full", revision="experiment")
    assert {b.name: b.target_commit for b in api.list_repo_refs("me/janus-full").branches} == {
        "main": second.oid, "experiment": branch.oid}


def test_push_never_uploads_theta0_snapshots_or_pickles(hub, delta, tmp_path, caplog):
    from huggingface_hub import HfApi
    from safetensors.torch import save_file

    from hf_janus.publish.hub import push_folder

    out = delta.save_adapter(tmp_path / "out", progress=False)
    save_file({"w": torch.zeros(2)}, os.path.join(out, "_janus_theta0.safetensors"))
    with open(os.path.join(out, "training_args.bin"), "wb") as fh:
        fh.write(b"\x80\x04not really a pickle")
    os.makedirs(os.path.join(out, "checkpoint-2"))
    save_file({"w": torch.zeros(2)}, os.path.join(out, "checkpoint-2", "_janus_theta0.safetensors"))
    with caplog.at_level("WARNING", logger="hf_janus.publish.hub"):
        push_folder(out, "me/no-leaks")
    files = set(HfApi().list_repo_files("me/no-leaks"))
    assert "adapter_model.safetensors" in files and REPORT_NAME in files
    assert not {"_janus_theta0.safetensors", "training_args.bin"} & files
    assert not [f for f in files if f.startswith("checkpoint-")]
    assert "training_args.bin" in caplog.text  # the user is told what stayed local


def record_sleeps(monkeypatch) -> list[float]:
    """The seconds ``time.sleep`` is asked for on this thread from now on (the local hub's threads left out)."""
    waits: list[float] = []
    sleep, caller = time.sleep, threading.current_thread()

    def recorded(seconds: float) -> None:
        if threading.current_thread() is caller:
            waits.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    return waits


def test_auth_failure_and_dead_server_leave_the_local_output_intact(hub, delta, tmp_path, monkeypatch):
    out = delta.save_adapter(tmp_path / "out", progress=False)
    before = folder_bytes(out)
    with pytest.raises(JanusError, match=r"refused .*'me/refused'.*HTTP 401.*hf auth login.*not changed"):
        push_folder(out, "me/refused", token="hf_wrong")
    with pytest.raises(JanusError, match="HTTP 401"):
        delta.push_to_hub("me/refused", token="hf_wrong", progress=False)
    assert not hub.repo_exists("me/refused")
    assert folder_bytes(out) == before

    with LocalHub(token=TOKEN) as dying, patch_hub_clients(dying, tmp_path / "hf_home_dead"):
        dying.stop()
        waits = record_sleeps(monkeypatch)
        with pytest.raises(JanusError, match=r"could not reach the Hugging Face Hub.*not changed"):
            push_folder(out, "me/unreachable")
        assert waits == []  # fails at once: no retry waited for (huggingface_hub's back-off sleeps between tries)
    assert folder_bytes(out) == before
    assert sorted(os.listdir(tmp_path)) == ["hf_home_dead", "out"]  # no temporary leftovers


def test_load_report_errors_name_the_problem(hub, delta, tmp_path):
    from huggingface_hub import HfApi

    with pytest.raises(JanusError, match="has no janus_rectification.json: it was not published with hf-janus"):
        load_report("me/tiny-base")
    with pytest.raises(JanusError, match="does not exist or you have no access"):
        load_report("me/no-such-repo")
    with pytest.raises(JanusError, match="does not exist"):
        load_report(tmp_path / "nowhere" / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(JanusError, match="has no janus_rectification.json"):
        load_report(empty)

    future = delta.published_report("adapter").to_dict()
    future["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "future.json").write_text(json.dumps(future))
    with pytest.raises(JanusError, match="newer than this hf-janus reads.*upgrade"):
        load_report(tmp_path / "future.json")
    HfApi().upload_file(path_or_fileobj=json.dumps(future).encode(), path_in_repo=REPORT_NAME,
                        repo_id="me/tiny-lora")
    with pytest.raises(JanusError, match="upgrade"):
        load_report("me/tiny-lora")


def test_record_round_trips_and_a_bare_rectification_report_is_pointed_to_its_reader(delta, tmp_path):
    published = delta.published_report("full")
    again = PublishedReport.from_dict(json.loads(json.dumps(published.to_dict())))
    assert again.to_dict() == json.loads(json.dumps(published.to_dict()))
    assert "me/tiny-lora" in again.summary() and "replay: me/past-task [train], 6 rows" in again.summary()
    delta.report.rectification.save(tmp_path / REPORT_NAME)
    with pytest.raises(JanusError, match="not an hf-janus publication.*RectificationReport.load"):
        load_report(tmp_path / REPORT_NAME)
    assert RectificationReport.load(tmp_path / REPORT_NAME).alphas == delta.report.rectification.alphas


# ---- publishing a folder ----------------------------------------------------------------------------------
@pytest.fixture
def saved_model(tmp_path):
    """A saved tiny model with a user-written card and a non-weight safetensors file next to the weights."""
    from testing_utils import build_tiny
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    build_tiny("llama").save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: mit\ntags:\n- mine\n---\n\n# My model\n\nHand-written notes.\n")
    save_file({"x": torch.zeros(2)}, folder / "_janus_theta0.safetensors")
    return folder


def test_write_publication_files_merges_the_card_and_keeps_the_weights(delta, saved_model):
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    weights = saved_model / "model.safetensors"
    tensors = load_file(weights)
    snapshot = (saved_model / "_janus_theta0.safetensors").read_bytes()
    published = copy.deepcopy(delta.published_report("full"))
    write_publication_files(saved_model, published, repo_id="me/published")
    first = folder_bytes(saved_model)
    write_publication_files(saved_model, published, repo_id="me/published")
    assert folder_bytes(saved_model) == first  # idempotent: one block, same bytes

    card = ModelCard.load(saved_model / "README.md")
    assert card.data.license == "mit" and card.data.tags == ["mine", *JANUS_TAGS]
    assert card.data.library_name == "transformers" and card.data.base_model == "me/tiny-base"
    assert "# My model" in card.text and "Hand-written notes." in card.text
    assert card.text.count(BLOCK_BEGIN) == 1 and "## JANUS-rectified tiny-lora" in card.text  # a section
    # the residual says which J0 it was measured against (bf16 factors once made it near zero by construction)
    assert published.rectification.residual_jacobian == REFERENCE_JACOBIAN
    assert f"(measured against {REFERENCE_JACOBIAN})" in card.text
    loaded = load_file(weights)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert read_safetensors_metadata(weights)["janus.base_model"] == "me/tiny-base"
    assert (saved_model / "_janus_theta0.safetensors").read_bytes() == snapshot  # not a weight file
    assert not [n for n in os.listdir(saved_model) if n.startswith(".")]  # no temporary files left
    assert load_report(saved_model).to_dict() == published.to_dict()


def test_write_publication_files_refuses_what_it_cannot_publish(delta, saved_model, tmp_path):
    with pytest.raises(JanusError, match="holds no safetensors weights"):
        write_publication_files(tmp_path, delta.report.rectification)
    with pytest.raises(JanusError, match="kind='adapter' but .* holds a full model"):
        write_publication_files(saved_model, delta.report.rectification, kind="adapter")
    with pytest.raises(JanusError, match="strings"):
        add_safetensors_metadata(saved_model / "model.safetensors", {"janus.x": 1})
    (saved_model / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(JanusError, match="not a readable safetensors file"):
        write_publication_files(saved_model, delta.report.rectification)


# ---- Trainer ----------------------------------------------------------------------------------------------
def test_trainer_push_to_hub_carries_the_record_with_the_hooks(hub, tmp_path):
    """``Trainer.push_to_hub`` re-saves the weights and rewrites README.md right before uploading, so files
    written beforehand lose their metadata; with ``install_trainer_hooks`` the upload carries it."""
    from huggingface_hub import HfApi, ModelCard, hf_hub_download
    from transformers import Trainer, TrainingArguments

    model = hub_base().train()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = [{"input_ids": torch.randint(0, 48, (10,)).tolist()} for _ in range(8)]

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=5e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, hub_model_id="me/trained-janus", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.train()
    replay = random_replay(6)
    report = rectify(trainer.model, reference, replay, fast_config(), progress=False)
    out = args.output_dir

    # What a callback writing at train end would get without the hooks: the Trainer overwrites it all.
    trainer.save_model()
    write_publication_files(out, report, model=trainer.model, replay=replay)
    trainer.push_to_hub(commit_message="plain")
    plain_card = open(hf_hub_download("me/trained-janus", "README.md"), encoding="utf-8").read()
    plain_meta = read_safetensors_metadata(hf_hub_download("me/trained-janus", "model.safetensors"))
    assert BLOCK_BEGIN not in plain_card and not any(k.startswith("janus.") for k in plain_meta)

    install_trainer_hooks(trainer, lambda: report, replay=replay)
    commit = trainer.push_to_hub(commit_message="with janus")
    assert commit.oid == head(hub, "me/trained-janus")
    text = open(hf_hub_download("me/trained-janus", "README.md"), encoding="utf-8").read()
    card = ModelCard(text)
    assert BLOCK_BEGIN in text and "generated_from_trainer" in card.data.tags and set(JANUS_TAGS) <= set(card.data.tags)
    assert 'from_pretrained("me/trained-janus")' in text
    assert "janus" in HfApi().model_info("me/trained-janus").tags
    meta = read_safetensors_metadata(hf_hub_download("me/trained-janus", "model.safetensors"))
    assert meta["janus.base_model"] == "me/tiny-base" and meta["janus.base_model_sha"] == head(hub, "me/tiny-base")
    published = load_report("me/trained-janus")
    assert published.kind == "full" and published.alphas == report.alphas and published.adapter is None
    assert published.replay.size == 6 and published.replay.fingerprint.startswith("sha256:")

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained("me/trained-janus").eval()
    assert torch.equal(logits(loaded, IDS), logits(trainer.model.eval(), IDS))
    # a later save_model keeps the same record (no new timestamp, so no spurious commit)
    record = open(os.path.join(out, REPORT_NAME)).read()
    trainer.save_model()
    assert open(os.path.join(out, REPORT_NAME)).read() == record


def test_the_template_ships_with_the_wheel():
    """pyproject's package-data must cover the template, or ``pip install .`` installs a package without it."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        patterns = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["hf_janus"]
    names = sorted(os.listdir(os.path.join(root, "hf_janus", "model_card_templates")))
    assert names and all(any(fnmatch.fnmatch(f"model_card_templates/{n}", p) for p in patterns) for n in names)
    # the top-level model_card_templates/ of the repository layout shows the same files
    assert sorted(os.listdir(os.path.join(root, "model_card_templates"))) == names


def test_callback_with_trainer_pushes_a_rectified_adapter_with_its_record(hub, tmp_path):
    """The callback path end to end: LoRA training, rectification at train end, ``trainer.push_to_hub()``."""
    from huggingface_hub import HfApi, hf_hub_download
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Trainer, TrainingArguments

    from hf_janus import JanusCallback
    from hf_janus.integrations.snapshot import SNAPSHOT_NAME

    model = get_peft_model(hub_base().train(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    data = [{"input_ids": torch.randint(0, 48, (10,)).tolist()} for _ in range(8)]

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=5e-3, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, hub_model_id="me/callback-janus", seed=0)
    replay = random_replay(6)
    janus = JanusCallback(replay, fast_config(), snapshot="disk")
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[janus])
    janus.trainer = trainer
    trainer.train()
    assert not os.path.exists(os.path.join(args.output_dir, SNAPSHOT_NAME))  # deleted when the run ended
    trainer.push_to_hub(commit_message="rectified")

    files = set(HfApi().list_repo_files("me/callback-janus"))
    assert {"adapter_model.safetensors", "adapter_config.json", REPORT_NAME, "README.md"} <= files
    assert SNAPSHOT_NAME not in files  # θ0 stays local
    # Trainer's own upload would take training_args.bin, a pickle holding args.hub_token; the hooks skip it
    assert os.path.isfile(os.path.join(args.output_dir, "training_args.bin")) and "training_args.bin" not in files
    published = load_report("me/callback-janus")
    assert published.kind == "adapter" and published.alphas == janus.report.alphas
    assert published.rectification.output["format"] == "adapter"
    text = open(hf_hub_download("me/callback-janus", "README.md"), encoding="utf-8").read()
    assert BLOCK_BEGIN in text
    reloaded = PeftModel.from_pretrained(hub_base(), "me/callback-janus").eval()
    assert torch.equal(logits(reloaded, IDS), logits(model.eval(), IDS))


def test_checkpoints_pushed_to_the_hub_carry_no_theta0(hub, tmp_path, caplog):
    """With hub_strategy='checkpoint' Trainer uploads each checkpoint folder whole, so θ0 is kept out of them
    (and resuming such a run is refused at train begin, said up front)."""
    from huggingface_hub import HfApi
    from transformers import Trainer, TrainingArguments

    from hf_janus import JanusCallback
    from hf_janus.integrations.snapshot import SNAPSHOT_NAME

    data = [{"input_ids": torch.randint(0, 48, (10,)).tolist()} for _ in range(8)]

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=5e-3, report_to=[], save_strategy="steps", save_steps=2, use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False, push_to_hub=True,
                             hub_model_id="me/checkpointed-janus", hub_strategy="checkpoint", seed=0)
    janus = JanusCallback(random_replay(6), fast_config())
    trainer = Trainer(model=hub_base().train(), args=args, train_dataset=data, data_collator=collate,
                      callbacks=[janus])
    janus.trainer = trainer
    with caplog.at_level("WARNING", logger="hf_janus"):
        trainer.train()
    trainer.push_to_hub(commit_message="rectified")
    assert "θ0 is never published" in caplog.text
    files = set(HfApi().list_repo_files("me/checkpointed-janus"))
    assert "last-checkpoint/model.safetensors" in files  # the checkpoint was pushed ...
    assert not any(name.endswith(SNAPSHOT_NAME) for name in files)  # ... without θ0
    assert not os.path.exists(os.path.join(args.output_dir, "checkpoint-2", SNAPSHOT_NAME))
    assert janus.report is not None


def test_merger_against_a_refusing_or_offline_hub_names_the_fix(hub, tmp_path, monkeypatch):
    """Loading from the Hub with a wrong token, or offline: a JanusError naming the repo and the fix, before
    anything is written."""
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi()
    api.create_repo("me/private-lora", private=True, exist_ok=True)
    api.upload_folder(repo_id="me/private-lora", folder_path=snapshot_download("me/tiny-lora"))
    with pytest.raises(JanusError, match=r"'me/private-lora': the repo does not exist or you have no access.*token="):
        JanusMerger("me/tiny-base", "me/private-lora", random_replay(6), fast_config(), token="hf_wrong",
                    progress=False).run()
    # offline with an empty cache: no retries, unlike a dead server (huggingface_hub backs off ~23 s per call)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(JanusError, match=r"could not reach the Hugging Face Hub .* 'me/tiny-lora'.*HF_HUB_OFFLINE"):
        JanusMerger("me/tiny-base", "me/tiny-lora", random_replay(6), fast_config(), progress=False).run()
    assert not os.listdir(tmp_path)


def test_hub_unreachable_tells_no_answer_from_an_answer():
    import importlib

    from huggingface_hub.errors import (HfHubHTTPError, HTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    from hf_janus.errors import hub_unreachable

    def wrapped(outer, inner):
        try:
            try:
                raise inner
            except BaseException as err:
                raise outer from err
        except BaseException as err:
            return err

    http = importlib.import_module(HTTPError.__module__.split(".")[0])  # huggingface_hub's HTTP client
    response = http.Response(401, request=http.Request("GET", "http://hub/api/models/x"))
    assert hub_unreachable(OfflineModeIsEnabled("offline"))
    assert hub_unreachable(wrapped(LocalEntryNotFoundError("not cached"), http.ConnectError("refused")))
    assert hub_unreachable(wrapped(LocalEntryNotFoundError("not cached"), ConnectionRefusedError(111, "refused")))
    assert not hub_unreachable(HfHubHTTPError("401", response=response))
    assert not hub_unreachable(RepositoryNotFoundError("missing", response=response))
    assert not hub_unreachable(LocalEntryNotFoundError("not cached"))
