"""``hf-janus merge`` on the command line, and reading replay data from files, datasets directories and the Hub."""

from __future__ import annotations

import json
import os

import pytest
import torch
from merge_fixtures import (
    IDS,
    char_tokenizer,
    load_base,
    logits,
    qa_rows,
    save_base,
    text_rows,
    train_adapter,
    write_jsonl,
)

from hf_janus import MergeReport
from hf_janus.cli import main
from hf_janus.errors import JanusError
from hf_janus.publish.record_file import REPORT_NAME
from hf_janus.replay.sources import ReplayOptions, load_replay, parse_replay_spec, tokenize_replay

FAST = ["--tau", "0", "--compression-rank", "0", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = save_base(root / "base")
    return {
        "root": root, "base": base, "lora": train_adapter(base, root / "lora", "lora"),
        "text": write_jsonl(root / "past.jsonl", text_rows(6)), "qa": write_jsonl(root / "qa.jsonl", qa_rows(6)),
    }


# ---- help -------------------------------------------------------------------------------------------------
def _help_groups(command, capsys) -> dict[str, list[str]]:
    """``hf-janus COMMAND --help`` as {group title: the options it lists}, in order."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    groups: dict[str, list[str]] = {}
    title = None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            groups[title] = []
        elif title is not None and line.startswith("  -"):
            groups[title].append(line.split()[0].rstrip(","))
    return {title: options for title, options in groups.items() if options}  # not the epilog's "examples:"


@pytest.mark.parametrize("command", ["merge", "frontier"])
def test_help_shows_what_most_runs_set_first_and_the_engines_internals_last(command, capsys):
    """The options users set (inputs, replay, JANUS's main settings, the repair, the output) come first; the other
    settings in "advanced" groups after them, the engine's precision, memory and compression settings last."""
    import dataclasses

    from hf_janus import JanusConfig, ReplayOptions
    from hf_janus.cli_options import ADVANCED, ADVANCED_JANUS_TITLE, INTERNALS_TITLE, field_tier

    groups = _help_groups(command, capsys)
    titles = list(groups)
    assert titles[-1] == INTERNALS_TITLE and titles[-2] == ADVANCED_JANUS_TITLE
    first_advanced = next(i for i, t in enumerate(titles) if t.startswith(ADVANCED))
    assert all(t.startswith(ADVANCED) for t in titles[first_advanced:])  # no main group after an advanced one
    where = {option: title for title, options in groups.items() for option in options}
    for cls in (JanusConfig, ReplayOptions):
        for f in dataclasses.fields(cls):
            option = f.metadata.get("cli", "--" + f.name.replace("_", "-"))
            tier = field_tier(f)
            expected = {"internal": INTERNALS_TITLE, ADVANCED: ADVANCED_JANUS_TITLE}.get(tier) if cls is JanusConfig \
                else None
            if expected is not None:
                assert where[option] == expected, option
            else:
                assert where[option].startswith(ADVANCED) == (tier != "main"), (option, where[option])


def test_merge_help_shows_at_most_20_options_before_the_advanced_ones(capsys):
    from hf_janus.cli_options import ADVANCED

    groups = _help_groups("merge", capsys)
    main_options = [o for title, options in groups.items() if not title.startswith(ADVANCED) for o in options]
    assert len(main_options) <= 20, main_options
    for option in ("--base", "--adapter", "--replay", "--replay-self", "--new-task-samples", "--distill-steps",
                   "--keep-gain", "--output", "--format", "--adapter-rank", "--push-to-hub"):
        assert option in main_options, option


def test_help_lists_merge_and_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    top = capsys.readouterr().out
    assert "merge" in top and "demo" in top
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--base", "--adapter", "--replay", "DATASET[:SPLIT]", "--text-field", "--prompt-field",
                   "--response-field", "--replay-format", "--output", "--format", "{adapter,full}", "--adapter-rank",
                   "same|auto|INT|FLOAT", "--adapter-energy", "--refine", "--overwrite", "--push-to-hub", "--revision",
                   "--initial-adapter", "--allow-base-mismatch", "--tau", "--compression-rank", "--compression",
                   "examples:"):
        assert option in text, option


def test_janus_options_reach_the_config(capsys):
    from hf_janus.cli import merge_config, build_parser

    base = ["merge", "--base", "b", "--adapter", "a", "--replay", "r", "--output", "o"]
    config = merge_config(build_parser().parse_args(base + ["--compression", "randomized", "--compression-rank", "0"]))
    assert config.compression == "randomized" and config.compression_rank is None
    assert merge_config(build_parser().parse_args(base)).compression == "auto"
    tokens = merge_config(build_parser().parse_args(base + ["--constraint", "token_loss",
                                                            "--constraint-options", "tokens=2"]))
    assert (tokens.constraint, tokens.constraint_options) == ("token_loss", {"tokens": 2})
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(base + ["--constraint-options", "tokens"])
    assert exit_info.value.code == 2 and "--constraint-options" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(base + ["--compression", "svd"])
    assert exit_info.value.code == 2 and "invalid choice: 'svd'" in capsys.readouterr().err


def test_missing_required_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", "--base", "x"])
    assert exit_info.value.code == 2
    assert "--adapter" in capsys.readouterr().err


# ---- running ----------------------------------------------------------------------------------------------
def test_merge_adapter_then_refuse_then_overwrite_full(files, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "rectified"
    args = ["merge", "--base", files["base"], "--adapter", files["lora"], "--replay", files["text"],
            "--text-field", "text", "--output", os.fspath(out), "--format", "adapter", "--adapter-rank", "auto",
            "--adapter-energy", "0.95", "--refine", *FAST]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "rectified adapter written to" in printed and "LoRA re-factorization" in printed
    report = MergeReport.load(out / REPORT_NAME)
    assert report.refactorization["refine"] is True and report.replay == files["text"]
    assert all(s["kept_energy"] >= 0.95 for s in report.refactorization["layers"])
    reloaded = PeftModel.from_pretrained(load_base(files["base"]), out).eval()
    assert logits(reloaded, IDS).shape == (2, IDS.shape[1], 48)
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}

    # the same output again: refused before any work, nothing touched
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before

    full = ["merge", "--base", files["base"], "--adapter", files["lora"], "--replay", files["qa"] + ":train",
            "--output", os.fspath(out), "--format", "full", "--overwrite", *FAST]
    assert main(full) == 0
    assert "adapter_config.json" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not torch.equal(logits(model, IDS), logits(load_base(files["base"]), IDS))
    assert MergeReport.load(out / REPORT_NAME).output_format == "full"
    assert sorted(os.listdir(tmp_path)) == ["rectified"]


def test_bad_inputs_exit_2_with_a_message(files, tmp_path, capsys):
    common = ["--output", os.fspath(tmp_path / "o"), *FAST]
    cases = [
        (["--base", files["base"], "--adapter", files["base"], "--replay", files["text"]], "no adapter_config.json"),
        (["--base", files["base"], "--adapter", files["lora"], "--replay", os.fspath(tmp_path / "none.jsonl")],
         "does not exist"),
        (["--base", files["base"], "--adapter", files["lora"], "--replay", files["text"], "--adapter-rank", "0"],
         "adapter_rank"),
        (["--base", files["base"], "--adapter", files["lora"], "--replay", files["text"], "--text-field", "body"],
         "no column"),
    ]
    for extra, message in cases:
        assert main(["merge", *extra, *common]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_push_to_hub_and_replay_from_a_hub_dataset(files, tmp_path):
    from hub_server import LocalHub, patch_hub_clients
    from huggingface_hub import HfApi

    payload = "".join(json.dumps(r) + "\n" for r in text_rows(5))
    with LocalHub() as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
        api = HfApi()
        api.create_repo("me/past-task", repo_type="dataset")
        api.upload_file(path_or_fileobj=payload.encode(), path_in_repo="data/train.jsonl", repo_id="me/past-task",
                        repo_type="dataset")
        out = tmp_path / "out"
        code = main(["merge", "--base", files["base"], "--adapter", files["lora"], "--replay", "me/past-task:train",
                     "--output", os.fspath(out), "--push-to-hub", "me/rectified", *FAST])
        pushed = set(hub.list_files("me/rectified"))
        card = hub.read_file("me/rectified", "README.md").decode()
    assert code == 0
    assert {"adapter_config.json", "adapter_model.safetensors", REPORT_NAME} <= pushed
    assert "hf-janus" in card and "library_name: peft" in card
    assert "base_model:" not in card  # a local base path is no valid Hub base_model
    assert MergeReport.load(out / REPORT_NAME).rectification.num_samples == 5


# ---- replay data ------------------------------------------------------------------------------------------
def test_parse_replay_spec(tmp_path):
    assert parse_replay_spec("org/data:validation") == ("org/data", "validation")
    assert parse_replay_spec("data.jsonl:train[:256]") == ("data.jsonl", "train[:256]")
    assert parse_replay_spec("org/data") == ("org/data", None)
    odd = tmp_path / "a:b.jsonl"  # an existing path is never split
    odd.write_text("{}\n")
    assert parse_replay_spec(os.fspath(odd)) == (os.fspath(odd), None)


def test_replay_from_files_and_datasets_directories(files, tmp_path):
    import datasets

    tok = char_tokenizer()
    expected = [tok(r["text"])["input_ids"] for r in text_rows(6)]
    sources = {"jsonl": files["text"]}
    datasets.Dataset.from_list(text_rows(6)).to_parquet(tmp_path / "past.parquet")
    sources["parquet"] = os.fspath(tmp_path / "past.parquet")
    datasets.Dataset.from_list(text_rows(6)).save_to_disk(tmp_path / "saved")
    sources["save_to_disk"] = os.fspath(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(text_rows(6)),
                          "test": datasets.Dataset.from_list(text_rows(2))}).save_to_disk(tmp_path / "saved-dict")
    sources["save_to_disk dict"] = os.fspath(tmp_path / "saved-dict")
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", text_rows(6))
    sources["data folder"] = os.fspath(tmp_path / "folder")
    for what, source in sources.items():
        samples = load_replay(source, tok)
        assert [s["input_ids"] for s in samples] == expected, what
        assert all("labels" not in s and s["attention_mask"] == [1] * len(s["input_ids"]) for s in samples)
    assert len(load_replay(sources["save_to_disk dict"] + ":test", tok)) == 2
    assert len(load_replay(files["text"] + ":train[:3]", tok)) == 3
    assert len(load_replay(files["text"], tok, ReplayOptions(num_samples=4))) == 4
    with pytest.raises(JanusError, match="no split 'dev'"):
        load_replay(sources["save_to_disk dict"] + ":dev", tok)


def test_replay_formats_and_their_errors(tmp_path):
    import datasets

    tok = char_tokenizer()
    qa = datasets.Dataset.from_list(qa_rows(3))
    samples = tokenize_replay(qa, tok)  # auto -> prompt-response: only response tokens (and EOS) count
    for sample, row in zip(samples, qa_rows(3)):
        prompt = tok(row["prompt"])["input_ids"]
        response = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert sample["input_ids"] == prompt + response
        assert sample["labels"] == [-100] * len(prompt) + response
    cut = tokenize_replay(qa, tok, ReplayOptions(max_length=8))  # prompts are cut before responses
    assert len(cut) == 3 and all(len(s["input_ids"]) <= 8 and s["labels"][-1] != -100 for s in cut)
    assert all(s["labels"][:4] == [-100] * 4 for s in cut)
    tokens = datasets.Dataset.from_list([{"input_ids": [1, 5, 6, 7], "labels": [-100, 5, 6, 7]}])
    assert tokenize_replay(tokens, None) == [{"input_ids": [1, 5, 6, 7], "attention_mask": [1, 1, 1, 1],
                                              "labels": [-100, 5, 6, 7]}]
    with pytest.raises(JanusError, match="no tokenizer"):
        tokenize_replay(datasets.Dataset.from_list(text_rows(2)), None)
    with pytest.raises(JanusError, match="cannot tell how to read"):
        tokenize_replay(datasets.Dataset.from_list([{"body": "x"}]), tok)
    with pytest.raises(JanusError, match="unsupported extension"):
        (tmp_path / "x.xml").write_text("<a/>")
        load_replay(os.fspath(tmp_path / "x.xml"), tok)
    with pytest.raises(JanusError, match="empty"):
        tokenize_replay(datasets.Dataset.from_list([]), tok)


def test_every_config_field_is_an_option():
    """The JANUS options are built from JanusConfig's fields: each one reaches the config."""
    import dataclasses

    from hf_janus import JanusConfig
    from hf_janus.cli import build_parser, merge_config

    base = ["merge", "--base", "b", "--adapter", "a", "--replay", "r", "--output", "o"]
    given = {"--tau": ("0.5", 0.5), "--beta": ("0.6", 0.6), "--compression-rank": ("7", 7),
             "--compression": ("exact", "exact"), "--target-modules": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
             "--exclude-modules": (["o_proj"], ["o_proj"]), "--replay-batch-size": ("3", 3),
             "--max-steps": ("9", 9), "--min-alpha": ("0.01", 0.01), "--gram-dtype": ("float32", torch.float32),
             "--gram-rcond": ("1e-8", 1e-8), "--materialize-max-bytes": ("1024", 1024), "--cache": ("d", "d"),
             "--seed": ("5", 5), "--step-control": ("paper", "paper"), "--max-evaluations": ("40", 40),
             "--max-seconds": ("90.5", 90.5), "--final-step": ("paper", "paper"),
             "--constraint-options": ("temperature=2.5", {"temperature": 2.5}),
             "--ghost-matmul": ("float64", "float64"),
             "--constraint": ("loss", "loss"),  # target_logit takes no temperature
             "--acceptance": ("both", "both"), "--acceptance-options": ("tolerance=0.3", {"tolerance": 0.3}),
             "--damping": ("0.02", 0.02),
             "--captures": ("two", "two"), "--factor-dtype": ("bfloat16", "bfloat16"), "--distill-steps": ("11", 11),
             "--keep-gain": ("0.9", 0.9), "--distill-lr": ("2e-5", 2e-5), "--new-task-weight": ("0.5", 0.5),
             "--new-task-batch-size": ("3", 3), "--distill-schedule": ("cosine", "cosine"),
             "--distill-replay-batch-size": ("5", 5)}
    argv = list(base)
    for flag, (text, _) in given.items():
        argv += [flag, *text] if isinstance(text, list) else [flag, text]
    config = merge_config(build_parser().parse_args(argv))
    assert len(given) == len(dataclasses.fields(JanusConfig))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(JanusConfig)}
    assert sorted(values.values(), key=repr) == sorted((v for _, v in given.values()), key=repr)
    # 0 means "no budget", as --compression-rank 0 means "no compression"
    config = merge_config(build_parser().parse_args(base + ["--max-evaluations", "0", "--max-seconds", "0"]))
    assert config.max_evaluations is None and config.max_seconds is None


def test_replay_options_from_the_command_line():
    from hf_janus.cli import build_parser, replay_options

    base = ["merge", "--base", "b", "--adapter", "a", "--replay", "r", "--output", "o"]
    assert replay_options(build_parser().parse_args(base)) == ReplayOptions()
    opts = replay_options(build_parser().parse_args(base + ["--prompt-field", "q", "--replay-samples", "0",
                                                            "--max-length", "64", "--replay-split", "test"]))
    assert opts == ReplayOptions(format="prompt-response", prompt_field="q", num_samples=None, max_length=64,
                                 split="test")
    assert replay_options(build_parser().parse_args(base + ["--text-field", "body"])).format == "text"
    with pytest.raises(JanusError, match="num_samples=-1 is invalid"):
        replay_options(build_parser().parse_args(base + ["--replay-samples", "-1"]))


def test_device_defaults_to_the_gpu_when_there_is_one(monkeypatch):
    """--device unset: cuda where there is a GPU (a user with one expects it used), the CPU (None) elsewhere."""
    from hf_janus.cli import parse_args

    argv = ["merge", "--base", "b", "--adapter", "a", "--replay", "r.jsonl", "--output", "o"]
    for available, expected in ((True, "cuda"), (False, None)):
        monkeypatch.setattr("torch.cuda.is_available", lambda: available)
        assert parse_args(argv).device == expected
        assert parse_args([*argv, "--device", "cpu"]).device == "cpu"
