"""Bad and hostile inputs from the fault audit: for each, the error (type and message) and that nothing was changed
on disk or in the model. Each case failed before its fix."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from conftest import random_replay
from merge_fixtures import fast_config, save_base, text_rows, train_adapter, write_jsonl

from hf_janus import JanusConfig, JanusError, JanusMerger
from hf_janus.cli import main
from hf_janus.engine.rectifier import Rectifier
from hf_janus.io_utils import atomic_output_dir, check_output_dir


def tree_digest(root) -> dict[str, str]:
    """Every file under ``root`` with the sha256 of its bytes."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder holding a base, an adapter and a replay file, as the audit's user had them."""
    root = tmp_path_factory.mktemp("hostile")
    base = save_base(root / "work" / "base")
    return {"root": root, "work": root / "work", "base": base,
            "adapter": train_adapter(base, root / "work" / "adapter", "lora"),
            "replay": write_jsonl(root / "work" / "past.jsonl", text_rows(6))}


# ---- 1. --overwrite never deletes an input -------------------------------------------------------------------

@pytest.mark.parametrize("where", ["adapter", "base", "work", "inside-adapter"])
def test_cli_overwrite_refuses_outputs_over_the_inputs(inputs, where, capsys):
    output = {"adapter": inputs["adapter"], "base": inputs["base"], "work": os.fspath(inputs["work"]),
              "inside-adapter": os.path.join(inputs["adapter"], "rectified")}[where]
    before = tree_digest(inputs["work"])
    code = main(["merge", "--base", inputs["base"], "--adapter", inputs["adapter"], "--replay", inputs["replay"],
                 "--output", output, "--overwrite", "--tau", "0", "--compression-rank", "0", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "would overwrite the" in err and "outside the inputs" in err
    assert tree_digest(inputs["work"]) == before


@pytest.mark.parametrize("fmt", ["adapter", "full"])
def test_save_refuses_outputs_over_the_inputs(inputs, fmt):
    delta = JanusMerger(inputs["base"], inputs["adapter"], inputs["replay"], fast_config(), progress=False).run()
    before = tree_digest(inputs["work"])
    save = delta.save_adapter if fmt == "adapter" else delta.save_full
    for output in (inputs["adapter"], inputs["work"], inputs["base"]):
        with pytest.raises(JanusError, match="would overwrite the"):
            save(output, overwrite=True)
    assert tree_digest(inputs["work"]) == before


def test_check_output_dir_follows_symlinks(tmp_path):
    real = tmp_path / "adapter"
    real.mkdir()
    (real / "adapter_model.safetensors").write_bytes(b"x")
    (tmp_path / "alias").symlink_to(real)
    with pytest.raises(JanusError, match="would overwrite the adapter"):
        check_output_dir(tmp_path / "alias", overwrite=True, inputs={"adapter": real})
    check_output_dir(tmp_path / "elsewhere", overwrite=True, inputs={"adapter": real, "replay data": None})


# ---- 2. a killed --overwrite is recovered -------------------------------------------------------------------

def test_killed_swap_is_restored_and_leftovers_are_cleaned(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "weights").write_text("old output")
    # What a SIGKILL between the two renames leaves: the old output aside, the new one half-written.
    old = tmp_path / ".out.old-abc123"
    os.rename(out, old)
    stale = tmp_path / ".out.tmp-def456"
    stale.mkdir()
    (stale / "partial").write_text("half")
    with pytest.raises(JanusError, match="not empty"):  # the restored output is protected again
        check_output_dir(out)
    assert (out / "weights").read_text() == "old output"
    assert not old.exists() and not stale.exists()
    with atomic_output_dir(out, overwrite=True) as tmp:
        with open(os.path.join(tmp, "weights"), "w") as fh:
            fh.write("new output")
    assert (out / "weights").read_text() == "new output"
    assert sorted(os.listdir(tmp_path)) == ["out"]


# ---- 5. shard names never leave the folder --------------------------------------------------------------------

@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/abs.safetensors", "sub/../../x.safetensors"])
def test_shard_index_paths_outside_the_folder_are_refused(tmp_path, shard):
    from hf_janus.publish.weights_meta import weight_files

    folder = tmp_path / "model"
    folder.mkdir()
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"not yours")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(JanusError, match="not a file name inside the folder"):
        weight_files(folder)
    assert outside.read_bytes() == b"not yours"


# ---- 7. an undefined c̄ is not a pass ----------------------------------------------------------------------------

def test_empty_trial_jacobian_does_not_pass(tuned_llama):
    """When every trial Jacobian is empty (the audit: weights x1e30), c̄ is not 1: the row space vanished."""
    model, reference = tuned_llama
    finetuned = {k: v.clone() for k, v in model.state_dict().items()}
    rectifier = Rectifier(model, reference, random_replay(4), JanusConfig(rank=4), progress=False)
    rectifier._write_all()
    rectifier._capture("c0")
    rectifier._project_all("c0")
    for layer in rectifier.layers:
        x, a = rectifier.store.get("c0", layer.name)
        rectifier.store.replace("empty", layer.name, torch.zeros_like(x), torch.zeros_like(a))
    cbar, per_layer = rectifier._compare_all("c0", "empty")
    assert cbar == 0.0 and set(per_layer.values()) == {0.0}
    rectifier._restore()
    rectifier.store.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, finetuned[key])
