"""The shared helpers: atomic replacement, local path vs Hub id, Hub cache paths, dataclass reading, safetensors
metadata through safetensors' own reader."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_replace, atomic_write_text, hub_cache_snapshot, is_local, looks_like_local_path
from hf_janus.publish.weights_meta import add_safetensors_metadata, read_safetensors_metadata
from hf_janus.serialization import known_fields

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_atomic_replace_keeps_the_original_when_the_write_fails(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"original")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_replace(path) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(b"half")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"original"
    assert os.listdir(tmp_path) == ["weights.bin"]  # no temporary left behind

    atomic_write_text(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["weights.bin"]


def test_atomic_replace_names_its_temporary_file_hidden(tmp_path):
    with atomic_replace(tmp_path / "out.json") as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith(".tmp-")
        open(tmp, "w").close()


@pytest.mark.parametrize("name, local", [
    ("org/name", False), ("name", False), ("./name", True), ("/abs/name", True), ("~/name", True),
    ("a/b/c", True), ("a\\b", True),
])
def test_local_path_or_hub_id(name, local):
    assert looks_like_local_path(name) is local
    assert is_local(name) is local


def test_an_existing_directory_is_local_whatever_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not looks_like_local_path("org/name") and is_local("org/name")


def test_hub_cache_snapshot_paths():
    model = f"/cache/hub/models--org--my-model/snapshots/{SHA}"
    assert hub_cache_snapshot(model) == ("org/my-model", "model", SHA)
    assert hub_cache_snapshot(model + "/config.json") == ("org/my-model", "model", SHA)
    assert hub_cache_snapshot(f"/c/datasets--ds/snapshots/{SHA}/data/x.parquet") == ("ds", "dataset", SHA)
    assert hub_cache_snapshot(f"/somewhere/snapshots/{SHA}") == (None, None, SHA)
    assert hub_cache_snapshot("/cache/hub/models--org--m/snapshots/abc123") is None  # not a commit
    assert hub_cache_snapshot("./my-model") is None and hub_cache_snapshot(None) is None


def test_known_fields_drops_or_refuses_unknown_keys():
    @dataclass
    class Point:
        x: int
        y: int = 0

    assert known_fields(Point, {"x": 1, "z": 2}) == {"x": 1}
    with pytest.raises(JanusError, match=r"Point has no field 'z': The fields are x, y"):
        known_fields(Point, {"x": 1, "z": 2}, strict=True)
    with pytest.raises(ValueError, match=r"Point has no field 'xx': did you mean 'x'\?"):  # a JanusError is one
        known_fields(Point, {"xx": 1}, strict=True)
    with pytest.raises(JanusError, match=r"Point has no field 'w': w is spelt W here"):
        known_fields(Point, {"w": 1}, strict=True, hints={"w": "w is spelt W here"})


def test_safetensors_metadata_round_trip_and_bad_files(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, path, metadata={"format": "pt", "janus.old": "x", "other": "kept"})
    add_safetensors_metadata(path, {"janus.kind": "full"})
    assert read_safetensors_metadata(path) == {"format": "pt", "other": "kept", "janus.kind": "full"}
    loaded = load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(JanusError, match="is not a readable safetensors file"):
        read_safetensors_metadata(bad)
    with pytest.raises(JanusError, match="is not a readable safetensors file"):
        add_safetensors_metadata(bad, {"janus.kind": "full"})
    assert bad.read_bytes() == b"not a safetensors file at all"
