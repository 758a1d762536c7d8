"""The model card's front matter beyond JANUS's own: the base model's licence, read from its card (a local folder or
the Hub), and a frontier's scores of the chosen point as ``model-index``; both parse back with huggingface_hub's
``ModelCard`` (which validates ``model-index``)."""

from __future__ import annotations

import json

import pytest
from hub_server import LocalHub, patch_hub_clients

from hf_janus import JanusConfig, RectificationReport
from hf_janus.engine.report import StepRecord, TrialRecord
from hf_janus.publish.card import render_card
from hf_janus.publish.provenance import RepoRef, resolve_repo
from hf_janus.publish.record_file import build_report, read_record

OTHER = "---\nlicense: other\nlicense_name: tiny-licence\nlicense_link: https://example.org/licence\n---\n# Tiny\n"


def record(tmp_path, base: RepoRef, frontier=None):
    rect = RectificationReport(config=JanusConfig().to_dict(), num_jacobian_evals=2, converged=True,
                               stop_reason="converged", replay_loss={"reference": 0.1, "finetuned": 1.0,
                                                                     "rectified": 0.2})
    rect.steps.append(StepRecord(step=0, alpha=1.0, trials=[TrialRecord(0, 1.0, 0.99, {"l": 0.99}, True, 0.2)]))
    data = build_report(rect, kind="full", base_model=base, online=False, frontier=frontier).to_dict()
    path = tmp_path / "janus_rectification.json"
    path.write_text(json.dumps(data))
    return read_record(str(path))


def parsed(card):
    from huggingface_hub import ModelCard

    return ModelCard(str(card), ignore_metadata_errors=False).data  # raises on a malformed model-index


def test_a_local_base_folders_licence_is_repeated_and_a_folder_without_a_card_adds_none(tmp_path):
    licensed, bare = tmp_path / "licensed", tmp_path / "bare"
    licensed.mkdir()
    bare.mkdir()
    (licensed / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Base\n")
    ref = resolve_repo(str(licensed), licence=True)
    assert ref.license == {"license": "apache-2.0"}
    data = parsed(render_card(record(tmp_path, ref), load_id="me/m"))
    assert data.license == "apache-2.0"
    assert resolve_repo(str(bare), licence=True).license is None
    assert parsed(render_card(record(tmp_path, resolve_repo(str(bare), licence=True)), load_id="me/m")).license is None


def test_a_hub_base_cards_other_licence_is_repeated_with_its_name_and_link(tmp_path):
    with LocalHub() as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo("me/licensed-base")
        api.upload_file(path_or_fileobj=OTHER.encode(), path_in_repo="README.md", repo_id="me/licensed-base")
        api.create_repo("me/no-card")
        api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="me/no-card")
        ref = resolve_repo("me/licensed-base", licence=True)
        assert ref.sha is not None
        assert ref.license == {"license": "other", "license_name": "tiny-licence",
                               "license_link": "https://example.org/licence"}
        assert resolve_repo("me/no-card", licence=True).license is None  # no card: nothing guessed
        assert resolve_repo("me/licensed-base").license is None  # an adapter's or dataset's card is not read
    data = parsed(render_card(record(tmp_path, ref), load_id="me/m"))
    assert (data.license, data.license_name, data.license_link) == (
        "other", "tiny-licence", "https://example.org/licence")


def test_a_cards_own_licence_is_kept_over_the_bases(tmp_path):
    ref = RepoRef(id="me/base", license={"license": "apache-2.0"})
    existing = "---\nlicense: mit\n---\n# My model\n"
    assert parsed(render_card(record(tmp_path, ref), load_id="me/m", existing=existing)).license == "mit"


def test_the_frontiers_scores_of_the_chosen_point_are_its_model_index(tmp_path):
    frontier = {"chosen": {"label": "janus", "kind": "janus", "ap1": 98.0, "ap2": 96.0,
                           "scores": {"nq_open": 0.25, "/data/gsm_new.jsonl": 0.5, "webq": float("nan")}},
                "criterion": "max AP", "past_tasks": ["nq_open", "webq"], "new_tasks": ["/data/gsm_new.jsonl"],
                "metrics": {"nq_open": "exact_match", "/data/gsm_new.jsonl": "nll"}, "points": []}
    data = parsed(render_card(record(tmp_path, RepoRef(id="me/base"), frontier=frontier), load_id="out/my-model"))
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in data.eval_results}
    assert results == {("nq_open", "exact_match"): 0.25, ("gsm_new.jsonl", "nll"): 0.5}  # NaN left out
    assert data.model_name == "my-model"
    # without a frontier (or with one of odd types) there is no model-index
    assert parsed(render_card(record(tmp_path, RepoRef(id="me/base")), load_id="me/m")).eval_results is None
    odd = {"chosen": {"scores": "high"}, "past_tasks": "nq", "new_tasks": [7]}
    assert parsed(render_card(record(tmp_path, RepoRef(id="me/base"), frontier=odd), load_id="me/m")).eval_results \
        is None


@pytest.mark.parametrize("card", ["---\nlicense: [unclosed\n---\n", "no front matter at all"])
def test_an_unreadable_or_licence_free_card_names_no_licence(tmp_path, card):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "README.md").write_text(card)
    assert resolve_repo(str(folder), licence=True).license is None


def test_a_records_odd_licence_entries_stay_out_of_the_front_matter(tmp_path):
    ref = RepoRef(id="me/base", license={"license": "mit", "tags": "spam", "license_name": ["x"]})
    data = parsed(render_card(record(tmp_path, ref), load_id="me/m"))
    assert data.license == "mit" and data.license_name is None and "spam" not in (data.tags or [])



def test_the_card_names_the_frontiers_candidates_by_the_titles_its_record_gives(tmp_path):
    points = [{"label": "wise a=0.5", "kind": "wise", "title": "WiSE-FT"},
              {"label": "janus τ=0.95", "kind": "janus", "title": "JANUS"},
              {"label": "janus τ=0.9", "kind": "janus", "title": "JANUS"},
              {"label": "made elsewhere", "kind": "unknown", "title": 7}]
    frontier = {"chosen": {"label": "janus τ=0.95", "kind": "janus", "ap1": 98.0, "ap2": 96.0, "scores": {},
                           "options": {"tau": 0.95}}, "criterion": "max AP", "points": points}
    card = str(render_card(record(tmp_path, RepoRef(id="me/base"), frontier=frontier), load_id="me/m"))
    assert "among 4 candidates (WiSE-FT, JANUS)" in card
