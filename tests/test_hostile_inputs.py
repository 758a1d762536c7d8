"""Bad and hostile inputs from the fault audit: for each, the error (type and message) and that nothing was changed
on disk or in the model. Each case failed before its fix."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from testing_utils import fail_capture, random_replay
from merge_fixtures import fast_config, save_base, text_rows, train_adapter, write_jsonl

from hf_janus import JanusConfig, JanusError, JanusMerger, RectificationError, rectify
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
    rectifier = Rectifier(model, reference, random_replay(4), JanusConfig(compression_rank=4), progress=False)
    loop = rectifier.make_loop()
    rectifier.layers.rewrite_current()
    rectifier.capture("c0")
    loop.project_all("c0")
    for layer in rectifier.layers:
        x, a = rectifier.store.get("c0", layer.name)
        rectifier.store.replace("empty", layer.name, torch.zeros_like(x), torch.zeros_like(a))
    cbar, per_layer = loop.compare_all("c0", "empty")
    assert cbar == 0.0 and set(per_layer.values()) == {0.0}
    rectifier.layers.restore()
    rectifier.store.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, finetuned[key])


# ---- 6, 8. inputs accepted without a word before -------------------------------------------------------------

def _sample(ids, mask=None):
    out = {"input_ids": ids}
    if mask is not None:
        out["attention_mask"] = mask
    return out


@pytest.mark.parametrize("replay,fragment", [
    ([_sample([1, 2, 3.5])], "not an integer"),
    ([_sample([1, float("nan"), 3])], "not an integer"),
    ([_sample([1, -4, 3])], "negative token id"),
    ([_sample([1, 2, 3], [1, 2, 1])], "other than 0 and 1"),
    ([_sample([1, 2, 10_000])], "vocabulary"),
    ([{"input_ids": torch.ones(2, 3, dtype=torch.long, device="meta")}], "meta device"),
    ([{"input_ids": torch.ones(2, 3)}], "must be integers"),
])
def test_malformed_replay_is_refused_and_the_model_kept(tuned_llama, replay, fragment):
    model, reference = tuned_llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(JanusError, match=fragment):
        Rectifier(model, reference, replay, JanusConfig(compression_rank=4), progress=False).run()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_integer_reference_is_refused(tuned_llama):
    model, reference = tuned_llama
    bad = {k: v.long() for k, v in reference.items()}
    with pytest.raises(JanusError, match="dtype torch.int64"):
        Rectifier(model, bad, random_replay(4), JanusConfig(compression_rank=4), progress=False)


def test_replay_that_fills_a_layer_warns(caplog):
    """m >= d_in·d_out leaves no null space: the whole update of the layer goes, and the user is told."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=4, intermediate_size=4, num_hidden_layers=1,
                                               num_attention_heads=1, num_key_value_heads=1,
                                               max_position_embeddings=32)).eval()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.add_(0.1 * torch.randn(4, 4))
    with caplog.at_level("WARNING", logger="hf_janus.engine.rectifier"):
        Rectifier(model, reference, random_replay(40, vocab=32), JanusConfig(tau=0.0, compression_rank=None,
                  target_modules=["q_proj"]), progress=False).run()
    assert "null space is empty" in caplog.text and "q_proj" in caplog.text


def test_config_file_that_is_not_json(tmp_path, capsys):
    bad = tmp_path / "janus.json"
    bad.write_text("tau: 0.9\n")
    with pytest.raises(ValueError, match="is not JSON"):
        JanusConfig.load(bad)
    code = main(["merge", "--base", "b", "--adapter", "a", "--replay", "r", "--output", str(tmp_path / "o"),
                 "--config", str(bad)])
    assert code == 2 and "is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("exc,kind", [(SystemExit(3), SystemExit), (RuntimeError("CPU out of memory"), "hint")])
def test_exit_passes_through_and_oom_gets_the_hint(tuned_llama, exc, kind):
    from hf_janus import RectificationError

    model, reference = tuned_llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    failing = fail_capture(2, exc)
    expected = SystemExit if kind is SystemExit else RectificationError
    with pytest.raises(expected) as info:
        Rectifier(model, reference, random_replay(4), JanusConfig(compression_rank=4), progress=False,
                  observer=failing).run()
    if kind is SystemExit:
        assert info.value is exc
    else:
        assert "replay_batch_size" in str(info.value)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_more_replay_samples_asked_than_there_are_rows_warns(caplog):
    from merge_fixtures import char_tokenizer

    from hf_janus.replay.sources import ReplayOptions, tokenize_replay

    with caplog.at_level("WARNING", logger="hf_janus.replay.sources"):
        samples = tokenize_replay(text_rows(6), char_tokenizer(), ReplayOptions(num_samples=1000), source="past.jsonl")
    assert len(samples) == 6
    assert "6 row(s), fewer than the 1000 asked for" in caplog.text


# ---- 9. records read from anywhere -----------------------------------------------------------------------------

def _record(tmp_path, **changes):
    from hf_janus import RectificationReport
    from hf_janus.engine.report import StepRecord, TrialRecord
    from hf_janus.publish.provenance import RepoRef
    from hf_janus.publish.record_file import build_report

    rect = RectificationReport(config=JanusConfig().to_dict(), num_jacobian_evals=2, converged=True,
                               stop_reason="converged", replay_loss={"reference": 0.1, "finetuned": 1.0,
                                                                     "rectified": 0.2})
    rect.steps.append(StepRecord(step=0, alpha=1.0, trials=[TrialRecord(0, 1.0, 0.99, {"l": 0.99}, True, 0.2)]))
    data = build_report(rect, kind="full", base_model=RepoRef(id="me/base"), online=False).to_dict()
    data.update(changes)
    path = tmp_path / "janus_rectification.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("changes,fragment", [
    ({"steps": "3"}, "steps must be a list"),
    ({"base_model": "me/base"}, "base_model must be an object"),
    ({"replay_loss": {"reference": "low"}}, "replay_loss must be an object of numbers"),
    ({"schema_version": "1"}, "schema_version must be an integer"),
    ({"num_jacobian_evals": -1}, "num_jacobian_evals must be a count"),
    ({"kind": "evil"}, "kind must be one of"),
    ({"memory_plan": "lots"}, "memory_plan must be an object"),
    ({"frontier": ["chosen"]}, "frontier must be an object"),
    ({"steps": [{"step": 0, "alpha": "big", "trials": []}]}, "steps[0].alpha must be a number"),
])
def test_load_report_validates_what_it_reads(tmp_path, changes, fragment):
    from hf_janus import load_report

    path = _record(tmp_path, **changes)
    with pytest.raises(JanusError) as info:
        load_report(str(path))
    assert fragment in str(info.value) and "upgrade" not in str(info.value)


def test_load_report_refuses_a_record_that_does_not_say_what_it_describes(tmp_path):
    from hf_janus import load_report

    path = _record(tmp_path)
    data = json.loads(path.read_text())
    del data["kind"]
    path.write_text(json.dumps(data))
    with pytest.raises(JanusError, match="malformed: it has no kind"):
        load_report(str(path))


def test_load_report_of_deeply_nested_json(tmp_path):
    from hf_janus import load_report

    path = tmp_path / "janus_rectification.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(JanusError, match="nested too deeply"):
        load_report(str(path))


def test_card_escapes_ids_and_free_text(tmp_path):
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import read_record

    path = _record(tmp_path, converged=False, stop_reason="<script>alert(1)</script> [click](javascript:alert(1))",
                   base_model={"id": 'me/b"); import os; ("`x`|y', "local": False})
    card = str(render_card(read_record(str(path)), load_id='me/m"); os.system("x'))
    assert "<script>" not in card and "](javascript:" not in card
    assert 'from_pretrained("me/m\\"); os.system(\\"x")' in card  # still one string literal
    assert "`x`|y" not in card



def test_card_of_an_odd_frontier_field(tmp_path):
    """A record's frontier field of unexpected types still renders, escaped, and says what it can."""
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import read_record

    frontier = {"chosen": {"label": "<script>x</script>", "ap1": "high", "ap2": 91.25},
                "criterion": "max AP", "points": 3, "past_tasks": ["nq", 7], "new_tasks": "gsm"}
    card = str(render_card(read_record(str(_record(tmp_path, frontier=frontier))), load_id="me/m"))
    assert "How this model was chosen" in card and "<script>" not in card
    assert "AP1 -% (past tasks: nq, 7), AP2 91.2% (new tasks: -)" in card and "among several candidates" in card
    assert "involves no JANUS step" in card
    # a point with a JANUS step (its options hold tau) has the rectification record below
    chosen = {"label": "janus", "kind": "janus", "ap1": 80.0, "ap2": 91.0, "options": {"tau": 0.95},
              "description": "JANUS at τ=0.95."}
    card = str(render_card(read_record(str(_record(tmp_path, frontier={**frontier, "chosen": chosen}))),
                           load_id="me/m"))
    assert "JANUS at τ=0.95." in card and "involves no JANUS step" not in card


def test_card_names_the_settings_that_depart_from_the_paper(tmp_path):
    """A damped, re-targeted or loss-accepted run says so in the card (odd values escaped); the defaults add no row."""
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import read_record

    plain = str(render_card(read_record(str(_record(tmp_path))), load_id="me/m"))
    assert "other settings" not in plain
    config = {**JanusConfig().to_dict(), "damping": 0.05, "constraint": "target_logit", "acceptance": "<b>x</b>|"}
    card = str(render_card(read_record(str(_record(tmp_path, config=config))), load_id="me/m"))
    assert "| other settings | damping=0.05, acceptance=&lt;b&gt;x&lt;/b&gt;\\|, constraint=target\\_logit |" in card
    config = {**JanusConfig().to_dict(), "acceptance": "loss", "acceptance_options": {"tolerance": 0.5}}
    card = str(render_card(read_record(str(_record(tmp_path, config=config))), load_id="me/m"))
    assert "| other settings | acceptance=loss, acceptance\\_options=\\(tolerance=0.5\\) |" in card


# ---- errors that name the problem and the fix -------------------------------------------------------------------

def test_missing_base_is_named_as_such(inputs, tmp_path):
    with pytest.raises(JanusError, match="is not a directory: pass the folder the base"):
        JanusMerger(str(tmp_path / "no-such-base"), inputs["adapter"], inputs["replay"], fast_config(),
                    progress=False).run()


def test_empty_replay_file(inputs, tmp_path):
    empty = tmp_path / "past.jsonl"
    empty.write_text("")
    with pytest.raises(JanusError, match="is empty"):
        JanusMerger(inputs["base"], inputs["adapter"], str(empty), fast_config(), progress=False).run()


@pytest.mark.parametrize("damage", ["truncated", "pickle"])
def test_damaged_adapter_files(inputs, tmp_path, damage):
    import pickle
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(inputs["adapter"], adapter)
    weights = adapter / "adapter_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:50])
    else:  # a pickle that would run code when loaded, in place of the weights
        weights.unlink()

        class Payload:
            def __reduce__(self):
                return (os.system, ("touch " + str(tmp_path / "pwned"),))

        (adapter / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))
    before = tree_digest(adapter)
    # allow_pickle=True: past the default refusal of pickles (tests/adapters/test_pickle_policy.py),
    # to the restricted unpickler
    with pytest.raises(JanusError, match="corrupt, truncated or not a plain tensor file"):
        JanusMerger(inputs["base"], str(adapter), inputs["replay"], fast_config(), progress=False,
                    allow_pickle=True).run()
    assert not (tmp_path / "pwned").exists() and tree_digest(adapter) == before


def test_output_below_a_file_is_refused_up_front(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(JanusError, match="is not a directory"):
        check_output_dir(tmp_path / "file" / "out")


# ---- cases that held before the audit: bad configs, missing layers, NaN/Inf, bad replay, interruptions ----------

def _nan_in(model, reference, key="model.layers.1.mlp.up_proj.weight"):
    with torch.no_grad():
        model.get_parameter(key)[0, 0] = float("nan")
    return reference


def _inf_reference(model, reference, key="model.layers.0.self_attn.k_proj.weight"):
    return {**reference, key: torch.full_like(reference[key], float("inf"))}


def _other_architecture(model, reference):
    from testing_utils import build_tiny

    return build_tiny("gpt2")


def _peft_wrapped(model, reference):
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    return reference


REPLAY = random_replay(4)
# (case, change to (model, reference) -> reference, replay, config, expected error, message fragment)
RECTIFY_CASES = [
    ("nan-in-finetuned", _nan_in, REPLAY, None, JanusError, "up_proj.*NaN"),
    ("inf-in-reference", _inf_reference, REPLAY, None, JanusError, "reference weight.*k_proj.*NaN/Inf"),
    ("reference-missing-layer", lambda m, r: {k: v for k, v in r.items() if "layers.1.mlp" not in k}, REPLAY, None,
     JanusError, "missing key.*layers.1.mlp"),
    ("reference-other-architecture", _other_architecture, REPLAY, None, JanusError, "reference"),
    ("reference-wrong-shape", lambda m, r: {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in r.items()},
     REPLAY, None, JanusError, "shape .* does not match"),
    ("unsupported-target", None, REPLAY, JanusConfig(target_modules=["embed_tokens"]), JanusError,
     "cannot rectify.*embed_tokens.*Embedding"),
    ("unknown-target", None, REPLAY, JanusConfig(target_modules=["nonexistent"]), JanusError,
     "'nonexistent' matches no module"),
    ("peft-model", _peft_wrapped, REPLAY, None, JanusError, "PEFT adapter layer.*JanusMerger"),
    ("config-not-a-JanusConfig", None, REPLAY, {"tau": 0.9}, JanusError, "JanusConfig"),
    ("empty-replay", None, [], None, JanusError, "replay is empty"),
    ("untokenized-replay", None, [{"text": "hello"}], None, JanusError, "input_ids.*tokenize"),
    ("nothing-counted", None, [{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}], None, JanusError,
     "no token that counts"),
    ("mask-length", None, [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [1, 2], "attention_mask": [1]}], None,
     JanusError, "replay sample 1: attention_mask has length 1"),
]


@pytest.mark.parametrize("change,replay,config,error,fragment", [case[1:] for case in RECTIFY_CASES],
                         ids=[case[0] for case in RECTIFY_CASES])
def test_bad_rectify_inputs_are_refused_and_the_model_kept(tuned_llama, change, replay, config, error, fragment):
    model, reference = tuned_llama
    if change is not None:
        reference = change(model, reference)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [(p.requires_grad, model.training) for p in model.parameters()]
    with pytest.raises(error, match=fragment):
        rectify(model, reference, replay, config if config is not None else JanusConfig(compression_rank=4),
                progress=False)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in after.items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, equal_nan=True)
    assert [(p.requires_grad, model.training) for p in model.parameters()] == flags


@pytest.mark.parametrize("exc", [FloatingPointError("injected NaN"), KeyboardInterrupt()], ids=["nan", "interrupt"])
def test_interrupted_rectification_restores_the_finetuned_weights(tuned_llama, exc):
    model, reference = tuned_llama
    finetuned = {k: v.clone() for k, v in model.state_dict().items()}
    failing = fail_capture(3, exc)
    expected = KeyboardInterrupt if isinstance(exc, KeyboardInterrupt) else RectificationError
    with pytest.raises(expected) as info:
        Rectifier(model, reference, random_replay(4), JanusConfig(tau=0.999, compression_rank=4), progress=False,
                  observer=failing).run()
    if expected is RectificationError:
        assert "injected NaN" in str(info.value) and "restored" in str(info.value)
    for key, value in model.state_dict().items():
        assert torch.equal(value, finetuned[key]), key
    assert all(p.requires_grad for p in model.parameters())
