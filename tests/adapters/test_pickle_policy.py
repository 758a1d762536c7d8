"""Pickled weights (issue 31, item 4): ``adapter_model.bin`` and ``pytorch_model.bin`` are refused unless the user
passes ``allow_pickle=True`` / ``--allow-pickle``; with it they are read with torch's restricted unpickler, and a
safetensors file is always read instead of a pickle next to it. From local folders and from the local Hub."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from testing_utils import build_tiny
from merge_fixtures import char_tokenizer, fast_config, save_base, text_rows, train_adapter, write_jsonl

from hf_janus import JanusError, JanusMerger
from hf_janus.adapters.saved.loading import load_base_model, model_weights_format, resolve_adapter
from hf_janus.cli import main
from hf_janus.evaluation.harness import load_model


class _Payload:
    """A pickle that runs a shell command when unpickled without restriction."""

    def __init__(self, marker):
        self.marker = os.fspath(marker)

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def _save_pickled_base(folder, seed: int = 0) -> str:
    """The tiny base of :func:`save_base` with its weights as ``pytorch_model.bin`` only (transformers >= 5 can no
    longer write one), as older checkpoints on the Hub have them."""
    model = build_tiny("llama", seed=seed)
    os.makedirs(folder)
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    char_tokenizer().save_pretrained(folder)
    return os.fspath(folder)


def _pickle_adapter(adapter, folder) -> str:
    """A copy of ``adapter`` whose weights are ``adapter_model.bin`` (a plain tensor pickle) only."""
    from safetensors.torch import load_file

    shutil.copytree(adapter, folder)
    weights = os.path.join(folder, "adapter_model.safetensors")
    torch.save(load_file(weights), os.path.join(folder, "adapter_model.bin"))
    os.remove(weights)
    return os.fspath(folder)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pickles")
    base = save_base(root / "base")
    adapter = train_adapter(base, root / "adapter", "lora")
    return {"root": root, "base": base, "adapter": adapter,
            "base_bin": _save_pickled_base(root / "base-bin"),
            "adapter_bin": _pickle_adapter(adapter, root / "adapter-bin"),
            "replay": write_jsonl(root / "past.jsonl", text_rows(6))}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _assert_refusal(err: str, filename: str):
    """The error names the file, why it is refused and both ways out."""
    assert filename in err
    assert "can run code" in err
    assert "safetensors" in err and "allow_pickle=True" in err and "--allow-pickle" in err


# ---- adapters ----------------------------------------------------------------------------------------------------

def test_pickled_adapter_is_refused_without_the_flag(inputs):
    with pytest.raises(JanusError) as info:
        JanusMerger(inputs["base"], inputs["adapter_bin"], inputs["replay"], fast_config(), progress=False).run()
    _assert_refusal(str(info.value), os.path.join(inputs["adapter_bin"], "adapter_model.bin"))
    assert "safe_serialization=True" in str(info.value)


def test_pickled_adapter_is_read_with_the_flag(inputs):
    """With allow_pickle=True the .bin adapter gives exactly the rectification of its safetensors twin."""
    reference = JanusMerger(inputs["base"], inputs["adapter"], inputs["replay"], fast_config(), progress=False).run()
    pickled = JanusMerger(inputs["base"], inputs["adapter_bin"], inputs["replay"], fast_config(), progress=False,
                          allow_pickle=True).run()
    assert reference.layers.keys() == pickled.layers.keys()
    for name, layer in reference.layers.items():
        assert torch.equal(layer.matrix, pickled.layers[name].matrix), name


def test_allow_pickle_still_refuses_a_pickle_that_runs_code(inputs, tmp_path):
    """The flag opens torch's restricted unpickler, not the unrestricted one: a code-running pickle still fails."""
    adapter = tmp_path / "adapter"
    shutil.copytree(inputs["adapter"], adapter)
    (adapter / "adapter_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(JanusError, match="can run code"):
        JanusMerger(inputs["base"], str(adapter), inputs["replay"], fast_config(), progress=False).run()
    with pytest.raises(JanusError, match="not a plain tensor file"):
        JanusMerger(inputs["base"], str(adapter), inputs["replay"], fast_config(), progress=False,
                    allow_pickle=True).run()
    assert not marker.exists()


def test_safetensors_is_read_and_a_pickle_beside_it_never_is(inputs, tmp_path):
    """A folder holding both formats needs no flag: the safetensors files are read, the pickles not even opened."""
    marker = tmp_path / "pwned"
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    shutil.copytree(inputs["adapter"], adapter)
    shutil.copytree(inputs["base"], base)
    for folder, name in ((adapter, "adapter_model.bin"), (base, "pytorch_model.bin")):
        (folder / name).write_bytes(pickle.dumps(_Payload(marker)))
    assert model_weights_format(str(base)) == ("safetensors", "model.safetensors")
    delta = JanusMerger(str(base), str(adapter), inputs["replay"], fast_config(), progress=False,
                        allow_base_mismatch=True).run()
    assert delta.layers and not marker.exists()


def test_allow_pickle_must_be_a_bool(inputs):
    with pytest.raises(JanusError, match="allow_pickle must be True or False"):
        JanusMerger(inputs["base"], inputs["adapter_bin"], inputs["replay"], allow_pickle="no")


# ---- base models -------------------------------------------------------------------------------------------------

def test_pickled_base_is_refused_without_the_flag(inputs):
    assert model_weights_format(inputs["base_bin"]) == ("pickle", "pytorch_model.bin")
    with pytest.raises(JanusError) as info:
        load_base_model(inputs["base_bin"])
    _assert_refusal(str(info.value), os.path.join(inputs["base_bin"], "pytorch_model.bin"))
    with pytest.raises(JanusError, match="pytorch_model.bin"):
        JanusMerger(inputs["base_bin"], inputs["adapter"], inputs["replay"], fast_config(), progress=False,
                    allow_base_mismatch=True).run()


def test_pickled_base_is_read_with_the_flag(inputs):
    model = load_base_model(inputs["base_bin"], allow_pickle=True)
    _assert_same_weights(model, build_tiny("llama", seed=0))


def test_a_folder_without_weights_is_named_as_such(inputs, tmp_path):
    empty = tmp_path / "empty"
    shutil.copytree(inputs["base"], empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(JanusError, match="has no weights: none of model.safetensors"):
        load_base_model(str(empty))
    with pytest.raises(JanusError, match="holds a PEFT adapter"):
        load_base_model(inputs["adapter"])


def test_cli_merge_refuses_pickles_and_reads_them_with_allow_pickle(inputs, tmp_path, capsys):
    args = ["merge", "--base", inputs["base_bin"], "--adapter", inputs["adapter_bin"], "--replay", inputs["replay"],
            "--text-field", "text", "--allow-base-mismatch", "--tau", "0", "--compression-rank", "0",
            "--no-progress"]
    assert main([*args, "--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "adapter_model.bin" in err and "--allow-pickle" in err
    assert not (tmp_path / "refused").exists()
    assert main([*args, "--output", str(tmp_path / "out"), "--allow-pickle"]) == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()  # the output is safetensors, always


# ---- evaluation ----------------------------------------------------------------------------------------------------

def test_evaluation_loads_follow_the_same_policy(inputs):
    """hf_janus.evaluate/frontier load their models with load_model: the same refusal, the same flag."""
    with pytest.raises(JanusError, match="pytorch_model.bin"):
        load_model(inputs["base_bin"])
    with pytest.raises(JanusError, match="adapter_model.bin"):
        load_model(inputs["adapter_bin"])
    _assert_same_weights(load_model(inputs["base_bin"], allow_pickle=True), load_model(inputs["base"]))
    _assert_same_weights(load_model(inputs["adapter_bin"], allow_pickle=True), load_model(inputs["adapter"]))


# ---- from the Hub ------------------------------------------------------------------------------------------------

def test_hub_pickles_are_refused_before_download_and_read_with_the_flag(inputs, tmp_path, monkeypatch):
    from hub_server import LocalHub, patch_hub_clients

    # transformers would ask the real Hub's conversion service to convert a pickled repo it reads
    monkeypatch.setenv("DISABLE_SAFETENSORS_CONVERSION", "1")
    with LocalHub() as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
        from huggingface_hub import HfApi

        api = HfApi()
        for repo, folder in (("me/base-bin", inputs["base_bin"]), ("me/lora-bin", inputs["adapter_bin"])):
            api.create_repo(repo)
            api.upload_folder(repo_id=repo, folder_path=folder)

        with pytest.raises(JanusError) as info:
            resolve_adapter("me/lora-bin")
        _assert_refusal(str(info.value), "adapter_model.bin in the Hub repo")
        with pytest.raises(JanusError) as info:
            load_base_model("me/base-bin")
        _assert_refusal(str(info.value), "pytorch_model.bin in the Hub repo")
        downloads = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".bin")]
        assert not downloads, "a refused pickle must not even be downloaded"

        assert os.path.isfile(os.path.join(resolve_adapter("me/lora-bin", allow_pickle=True).path,
                                           "adapter_model.bin"))
        _assert_same_weights(load_base_model("me/base-bin", allow_pickle=True), build_tiny("llama", seed=0))
        fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET" and r[1].endswith(".bin")}
        assert fetched == {"adapter_model.bin", "pytorch_model.bin"}  # what the flag let through
