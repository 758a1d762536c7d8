"""``tests/hub_server.LocalHub`` against the real huggingface_hub, transformers, peft and datasets clients.

Most tests drive the clients in-process through ``patch_hub_clients`` (fast: torch and transformers are
imported once); ``test_subprocess_*`` use the reference path -- a fresh interpreter whose environment from
``hub_env`` sets ``HF_ENDPOINT`` & co. before anything is imported.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from hub_server import LocalHub, hub_env, patch_hub_clients, run_client, run_client_json

TOKEN = "hf_localhub_test_token"
README = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- janus
- tiny
datasets:
- me/some-data
---

# Tiny test model
"""


@pytest.fixture(scope="module")
def hub():
    """One token-protected hub for the module; tests use distinct repo ids."""
    with LocalHub(token=TOKEN) as local_hub:
        yield local_hub


@pytest.fixture
def clients(hub, tmp_path):
    """The already imported clients of this process, pointed at ``hub`` with an empty private cache."""
    with patch_hub_clients(hub, tmp_path / "hf_home") as env:
        yield env


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(config).eval()


INPUT_IDS = torch.tensor([[1, 5, 9, 13, 2], [7, 3, 3, 60, 0]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).logits


def http(hub: LocalHub, method: str, path: str, *, body: bytes | None = None, headers: dict | None = None):
    """A raw request to the hub: ``(status, headers, body)``, errors included."""
    request = urllib.request.Request(hub.endpoint + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def is_connection_error(exc: BaseException) -> bool:
    """httpx(2).ConnectError, whichever httpx the installed huggingface_hub uses."""
    return any(cls.__name__ == "ConnectError" for cls in type(exc).__mro__)


# ------------------------------------------------------------------------------------------------------------
# transformers / peft / datasets, in-process
# ------------------------------------------------------------------------------------------------------------


def test_transformers_push_to_hub_and_from_pretrained(hub, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    with patch_hub_clients(hub, tmp_path / "hf_home"):
        commit = model.push_to_hub("me/tiny-llama")
        loaded = AutoModelForCausalLM.from_pretrained("me/tiny-llama").eval()
    assert commit.oid == hub.list_commits("me/tiny-llama")[0].oid
    assert torch.equal(logits(loaded), logits(model))
    files = hub.list_files("me/tiny-llama")
    assert files["model.safetensors"].lfs and not files["config.json"].lfs

    # A second client, offline, is served from the cache the first one filled.
    with patch_hub_clients(hub, tmp_path / "hf_home", offline=True):
        n_requests = len(hub.requests)
        cached = AutoModelForCausalLM.from_pretrained("me/tiny-llama").eval()
        assert len(hub.requests) == n_requests
    assert torch.equal(logits(cached), logits(model))


def test_peft_adapter_push_to_hub_and_upload_folder(hub, clients, tmp_path):
    from huggingface_hub import HfApi
    from peft import LoraConfig, PeftModel, get_peft_model

    tiny_llama().push_to_hub("me/peft-base")
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(tiny_llama(), lora).eval()
    expected = logits(peft_model)
    assert not torch.equal(expected, logits(tiny_llama()))  # the adapter changes the outputs

    peft_model.push_to_hub("me/lora-pushed")  # PeftModel.push_to_hub
    peft_model.save_pretrained(tmp_path / "adapter")  # save_pretrained + upload_folder
    api = HfApi()
    api.create_repo("me/lora-uploaded")
    api.upload_folder(folder_path=tmp_path / "adapter", repo_id="me/lora-uploaded")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(hub.list_files("me/lora-uploaded"))

    from transformers import AutoModelForCausalLM

    for repo_id in ("me/lora-pushed", "me/lora-uploaded"):
        base = AutoModelForCausalLM.from_pretrained("me/peft-base").eval()
        loaded = PeftModel.from_pretrained(base, repo_id).eval()
        torch.testing.assert_close(logits(loaded), expected)


def test_dataset_jsonl_hf_hub_download_and_load_dataset(hub, clients):
    import datasets
    from huggingface_hub import HfApi, hf_hub_download

    rows = [{"text": "alpha", "label": 0}, {"text": "beta", "label": 1}, {"text": "gamma", "label": 0}]
    payload = "".join(json.dumps(r) + "\n" for r in rows).encode()
    api = HfApi()
    api.create_repo("me/tiny-data", repo_type="dataset")
    api.upload_file(path_or_fileobj=payload, path_in_repo="data/train.jsonl", repo_id="me/tiny-data",
                    repo_type="dataset")

    path = hf_hub_download("me/tiny-data", "data/train.jsonl", repo_type="dataset")
    assert Path(path).read_bytes() == payload
    assert [s.rfilename for s in api.dataset_info("me/tiny-data").siblings] == [".gitattributes", "data/train.jsonl"]
    assert datasets.load_dataset("me/tiny-data", split="train").to_list() == rows


# ------------------------------------------------------------------------------------------------------------
# huggingface_hub API semantics
# ------------------------------------------------------------------------------------------------------------


def test_two_pushes_make_two_commits_and_old_revision_stays_readable(hub, clients):
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    api = HfApi()
    api.create_repo("me/history")
    first = api.upload_file(path_or_fileobj=b"version 1", path_in_repo="notes/v.txt", repo_id="me/history")
    second = api.upload_file(path_or_fileobj=b"version 2", path_in_repo="notes/v.txt", repo_id="me/history")

    commits = api.list_repo_commits("me/history")
    assert [c.commit_id for c in commits[:2]] == [second.oid, first.oid]
    assert [c.title for c in commits] == ["Upload notes/v.txt with huggingface_hub"] * 2 + ["initial commit"]
    assert api.model_info("me/history").sha == second.oid
    assert Path(hf_hub_download("me/history", "notes/v.txt")).read_bytes() == b"version 2"
    assert Path(hf_hub_download("me/history", "notes/v.txt", revision=first.oid)).read_bytes() == b"version 1"
    assert Path(snapshot_download("me/history", revision=first.oid), "notes/v.txt").read_bytes() == b"version 1"
    assert api.model_info("me/history", revision=first.oid[:10]).sha == first.oid

    # Unchanged content is skipped client-side thanks to the preupload oid: no third commit.
    api.upload_file(path_or_fileobj=b"version 2", path_in_repo="notes/v.txt", repo_id="me/history")
    assert len(api.list_repo_commits("me/history")) == 3

    api.create_branch("me/history", branch="old", revision=first.oid)
    api.create_tag("me/history", tag="v1", revision=first.oid)
    for rev in ("old", "v1"):
        assert Path(hf_hub_download("me/history", "notes/v.txt", revision=rev)).read_bytes() == b"version 1"
    refs = api.list_repo_refs("me/history")
    assert {b.name: b.target_commit for b in refs.branches} == {"main": second.oid, "old": first.oid}
    assert [f.path for f in api.list_repo_tree("me/history", recursive=True)] == [
        "notes", ".gitattributes", "notes/v.txt"]


def test_wrong_or_missing_token_is_401_for_writes(hub, clients):
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    api = HfApi()
    api.create_repo("me/guarded")
    for bad in ("hf_wrong", False):  # wrong token, no token at all
        with pytest.raises(HfHubHTTPError) as err:
            api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="me/guarded", token=bad)
        assert err.value.response.status_code == 401
        assert "Invalid credentials" in str(err.value)
        with pytest.raises(HfHubHTTPError) as err:
            api.create_repo("me/never-created", token=bad)
        assert err.value.response.status_code == 401
    assert not hub.repo_exists("me/never-created")
    assert api.model_info("me/guarded", token=False).id == "me/guarded"  # public reads need no token

    api.create_repo("me/secret", private=True)
    api.upload_file(path_or_fileobj=b"s", path_in_repo="s.txt", repo_id="me/secret")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("me/secret", "s.txt", token="hf_wrong")
    assert Path(hf_hub_download("me/secret", "s.txt")).read_bytes() == b"s"


def test_stopped_server_gives_connection_errors_and_restart_serves_again(tmp_path):
    from huggingface_hub import HfApi, hf_hub_download

    with LocalHub() as dying, patch_hub_clients(dying, tmp_path / "hf_home"):
        api = HfApi()
        api.create_repo("me/mortal")
        api.upload_file(path_or_fileobj=b"still here", path_in_repo="f.txt", repo_id="me/mortal")
        cached = hf_hub_download("me/mortal", "f.txt")  # also leaves a pooled keep-alive connection

        dying.stop()
        with pytest.raises(Exception) as err:
            api.model_info("me/mortal")
        assert is_connection_error(err.value), repr(err.value)
        # hf_hub_download falls back to the cache when the Hub is unreachable.
        assert hf_hub_download("me/mortal", "f.txt") == cached

        dying.start()
        assert api.model_info("me/mortal").id == "me/mortal"


def test_patch_hub_clients_restores_the_clients(hub, tmp_path):
    from huggingface_hub import constants, hf_api

    before = (constants.ENDPOINT, hf_api.api.endpoint, constants.HF_HUB_CACHE)
    with patch_hub_clients(hub, tmp_path / "hf_home"):
        assert constants.ENDPOINT == hf_api.api.endpoint == hub.endpoint
    assert (constants.ENDPOINT, hf_api.api.endpoint, constants.HF_HUB_CACHE) == before


# ------------------------------------------------------------------------------------------------------------
# Subprocess path (HF_ENDPOINT & co. set before import)
# ------------------------------------------------------------------------------------------------------------


def test_subprocess_model_info_tags_and_card_data(hub, tmp_path):
    out = run_client_json(
        f"""
        from huggingface_hub import HfApi
        api = HfApi()
        repo = api.create_repo("tiny-card")  # no namespace: lands in the token owner's
        api.upload_file(path_or_fileobj={README.encode()!r}, path_in_repo="README.md", repo_id=repo.repo_id)
        api.upload_file(path_or_fileobj=b'{{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}}',
                        path_in_repo="config.json", repo_id=repo.repo_id)
        info = api.model_info(repo.repo_id)
        api.create_repo("me/card-data", repo_type="dataset")
        api.upload_file(path_or_fileobj=b"---\\nlicense: mit\\ntags: [text]\\n---\\n", path_in_repo="README.md",
                        repo_id="me/card-data", repo_type="dataset")
        ds_info = api.dataset_info("me/card-data")
        emit(dict(repo_id=repo.repo_id, url=str(repo), who=api.whoami()["name"], tags=info.tags,
                  card=info.card_data.to_dict(), library=info.library_name, pipeline=info.pipeline_tag,
                  config=info.config, siblings=[s.rfilename for s in info.siblings],
                  ds_tags=ds_info.tags, ds_license=ds_info.card_data.license))
        """,
        hub_env(hub, tmp_path),
    )
    assert out["repo_id"] == "local-user/tiny-card" == f"{out['who']}/tiny-card"
    assert out["url"] == f"{hub.endpoint}/local-user/tiny-card"
    assert out["tags"] == ["janus", "tiny", "transformers", "license:apache-2.0"]
    assert out["card"] == {"license": "apache-2.0", "library_name": "transformers", "pipeline_tag": "text-generation",
                           "tags": ["janus", "tiny"], "datasets": ["me/some-data"]}
    assert (out["library"], out["pipeline"]) == ("transformers", "text-generation")
    assert out["config"] == {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert out["siblings"] == [".gitattributes", "README.md", "config.json"]
    assert (out["ds_tags"], out["ds_license"]) == (["text", "license:mit"], "mit")


def test_subprocess_from_pretrained_and_errors(hub, tmp_path):
    model = tiny_llama(seed=3)
    with patch_hub_clients(hub, tmp_path / "pusher"):
        model.push_to_hub("me/tiny-for-subprocess")
    out = run_client_json(
        """
        import torch
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("me/tiny-for-subprocess").eval()
        with torch.no_grad():
            logits = model(torch.tensor(%s)).logits
        try:
            HfApi(token="hf_wrong").upload_file(path_or_fileobj=b"x", path_in_repo="x",
                                                repo_id="me/tiny-for-subprocess")
            status = None
        except HfHubHTTPError as err:
            status = err.response.status_code
        import hashlib
        digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                   for k, v in model.state_dict().items()}
        emit(dict(logits=logits.tolist(), status=status, digests=digests))
        """ % INPUT_IDS.tolist(),
        hub_env(hub, tmp_path),
    )
    # The weights must arrive bit for bit; logits computed in another process may use another
    # thread count and so another summation order, hence the tolerance.
    expected = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                for k, v in model.state_dict().items()}
    assert out["digests"] == expected
    torch.testing.assert_close(torch.tensor(out["logits"], dtype=torch.float32), logits(model),
                               rtol=1e-5, atol=1e-6)
    assert out["status"] == 401

    failed = run_client("raise SystemExit(3)", hub_env(hub, tmp_path), check=False)
    assert failed.returncode == 3
    with pytest.raises(AssertionError, match="exit code 3"):
        run_client("raise SystemExit(3)", hub_env(hub, tmp_path))


# ------------------------------------------------------------------------------------------------------------
# Raw protocol details
# ------------------------------------------------------------------------------------------------------------


def test_protocol_errors_ranges_and_lfs_rules(hub):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    hub.create_repo("me/raw")
    sha = hub.commit("me/raw", {"a.txt": "0123456789"})

    status, headers, body = http(hub, "GET", "/me/raw/resolve/main/a.txt", headers={"Range": "bytes=2-4"})
    assert (status, body, headers["Content-Range"], headers["X-Repo-Commit"]) == (206, b"234", "bytes 2-4/10", sha)
    a_txt = hub.list_files("me/raw")["a.txt"]
    status, headers, _ = http(hub, "HEAD", f"/me/raw/resolve/{sha}/a.txt")
    assert (status, headers["Content-Length"], headers["ETag"]) == (200, "10", f'"{a_txt.git_oid}"')

    for path, code in (("/me/nope/resolve/main/a.txt", "RepoNotFound"), ("/me/raw/resolve/main/zz", "EntryNotFound"),
                       ("/me/raw/resolve/nobranch/a.txt", "RevisionNotFound")):
        status, headers, body = http(hub, "GET", path)
        assert (status, headers["X-Error-Code"]) == (404, code) and "error" in json.loads(body)

    create = json.dumps({"name": "raw", "organization": "me", "type": "model"}).encode()
    status, _, body = http(hub, "POST", "/api/repos/create", body=create, headers=auth)
    assert status == 409 and json.loads(body)["url"] == f"{hub.endpoint}/me/raw"
    status, _, body = http(hub, "POST", "/api/repos/create", body=create, headers={"Authorization": "Bearer nope"})
    assert status == 401 and json.loads(body)["error"]

    status, _, body = http(hub, "POST", "/api/validate-yaml", headers=auth,
                           body=json.dumps({"content": "---\nkey: [unclosed\n---\n"}).encode())
    assert status == 400 and json.loads(body)["errors"]
    status, _, _ = http(hub, "GET", "/api/models/me/raw/xet-write-token/main", headers=auth)
    assert status == 400

    files = [{"path": "w.safetensors", "size": 10, "sample": ""}, {"path": "notes.md", "size": 10, "sample": ""},
             {"path": "huge.txt", "size": 50 * 1024 * 1024, "sample": ""}, {"path": "a.txt", "size": 10, "sample": ""}]
    status, _, body = http(hub, "POST", "/api/models/me/raw/preupload/main", headers=auth,
                           body=json.dumps({"files": files}).encode())
    modes = {f["path"]: (f["uploadMode"], f["oid"]) for f in json.loads(body)["files"]}
    assert modes == {"w.safetensors": ("lfs", None), "notes.md": ("regular", None), "huge.txt": ("lfs", None),
                     "a.txt": ("regular", a_txt.git_oid)}

    hub.fail_next = [True]
    assert http(hub, "GET", "/api/models/me/raw")[0] == 503
    assert http(hub, "GET", "/api/models/me/raw")[0] == 200
