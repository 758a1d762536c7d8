"""JanusMerger end to end: every adapter kind's ΔW equals PEFT's own merge, rectification touches only the
adapted layers, save_adapter/save_full round-trip through stock PEFT/transformers loading, bad inputs fail
clearly, and a base + adapter pulled by repo id from the local fake Hub give the same result as from disk."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from merge_fixtures import (
    IDS,
    fast_config,
    load_base,
    logits,
    save_base,
    state,
    text_rows,
    train_adapter,
    write_jsonl,
)

from hf_janus import JanusConfig, JanusError, JanusMerger, MergeReport
from hf_janus.adapters.saved.effective import load_effective_model
from hf_janus.publish.record_file import REPORT_NAME
from hf_janus.replay.sources import load_replay

KINDS = ["lora", "rslora-patterns", "dora", "pissa", "pissa-niter", "loha", "embed-mts"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A saved tiny base (sharded, with tokenizer) and one trained adapter per kind."""
    root = tmp_path_factory.mktemp("merge")
    base = save_base(root / "base", max_shard_size="20KB")
    paths = {"root": root, "base": base}
    for kind in KINDS:
        extra = {}
        if kind.startswith("pissa"):
            extra = dict(initial_dir=root / f"{kind}-init", converted_dir=root / f"{kind}-converted")
            paths[f"{kind}-init"] = os.fspath(extra["initial_dir"])
            paths[f"{kind}-converted"] = os.fspath(extra["converted_dir"])
        paths[kind] = train_adapter(base, root / kind, kind, **extra)
    tok_replay = load_replay(write_jsonl(root / "replay.jsonl", text_rows(6)), load_tokenizer(base))
    paths["replay"] = tok_replay
    paths["replay_file"] = os.fspath(root / "replay.jsonl")
    return paths


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def peft_merged(base_dir, adapter_dir):
    """PEFT's own answer: PeftModel.from_pretrained on a fresh base, merge_and_unload."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(base_dir), adapter_dir).merge_and_unload().eval()


def adapted_deltas(eff):
    return {n: eff.delta(n) for n in eff.layers}


# ---- ΔW of every adapter kind ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lora", "rslora-patterns", "dora", "pissa", "loha", "embed-mts"])
def test_effective_weights_equal_peft_merge(ws, kind):
    eff = load_effective_model(ws["base"], ws[kind], progress=False)
    expected = state(peft_merged(ws["base"], ws[kind]))
    got = state(eff.model)
    assert got.keys() == expected.keys()
    for key in got:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)
    base = state(load_base(ws["base"]))
    for key, ref in eff.reference.items():  # θ0 = the untouched base weights of the adapted layers only
        if kind == "pissa":  # θ0 = W_res + s·B0A0 as the model began training: W up to W_res's rounding
            torch.testing.assert_close(ref, base[key], rtol=0, atol=1e-6, msg=key)
        else:
            assert torch.equal(ref, base[key]), key
    assert all(eff.delta(n).abs().max() > 0 for n in eff.layers)
    # only the adapted layers (and modules_to_save) differ from the base
    changed = {k[: -len(".weight")] for k in got if not torch.equal(got[k], base[k])}
    assert changed <= set(eff.layers) | set(eff.modules_to_save)


def test_adapter_kinds_and_layer_ranks(ws):
    kinds = {k: load_effective_model(ws["base"], ws[k], progress=False) for k in ("rslora-patterns", "dora", "pissa")}
    assert kinds["dora"].adapter.kind == "dora" and kinds["pissa"].adapter.kind == "pissa (unconverted)"
    ranks = {n.split(".")[-1]: layer.rank for n, layer in kinds["rslora-patterns"].layers.items()}
    assert ranks == {"q_proj": 4, "v_proj": 2, "down_proj": 4}  # rank_pattern honoured


@pytest.mark.parametrize("kind", ["pissa", "pissa-niter"])
def test_pissa_unconverted_equals_converted_relative_to_original_base(ws, kind):
    """ΔW of an unconverted PiSSA adapter (residual rebuilt, or via the initial adapter) is relative to the
    ORIGINAL base and equals PEFT's converted form (rank 2r) merged onto that base."""
    initial = ws[f"{kind}-init"] if kind == "pissa-niter" else None
    unconverted = load_effective_model(ws["base"], ws[kind], initial_adapter=initial, progress=False)
    converted = load_effective_model(ws["base"], ws[f"{kind}-converted"], progress=False)
    peft_converted = state(peft_merged(ws["base"], ws[f"{kind}-converted"]))
    assert converted.adapter.kind == "lora"
    for name in unconverted.layers:
        torch.testing.assert_close(unconverted.delta(name), converted.delta(name), rtol=0, atol=2e-6)
        torch.testing.assert_close(converted.model.get_submodule(name).weight, peft_converted[name + ".weight"])
        assert converted.layers[name].rank == 2 * unconverted.layers[name].rank  # converted form has rank 2r


def test_randomized_pissa_without_initial_adapter_is_refused(ws):
    with pytest.raises(JanusError, match="pissa_niter_2.*initial_adapter"):
        load_effective_model(ws["base"], ws["pissa-niter"], progress=False)


# ---- rectification -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_result(ws):
    return JanusMerger(ws["base"], ws["lora"], ws["replay"], fast_config(), progress=False).run()


def test_run_rectifies_exactly_the_adapted_layers(ws, lora_result):
    delta = lora_result
    base = state(load_base(ws["base"]))
    eff = load_effective_model(ws["base"], ws["lora"], progress=False)
    adapted = set(eff.layers)
    assert set(delta.layer_names) == adapted == set(delta.report.rectified_layers)
    assert {layer.name for layer in delta.report.rectification.layers} == adapted
    rect = state(delta.model)
    for key, value in rect.items():
        name = key[: -len(".weight")]
        if name in adapted:
            torch.testing.assert_close(value, base[key] + delta.delta(name), rtol=0, atol=1e-6)
            assert not torch.allclose(delta.delta(name), eff.delta(name))  # rectification changed ΔW
        else:
            assert torch.equal(value, base[key]), key
    # single-step JANUS without compression: ΔW_rect lies in the null space of J0. It is projected in float64 and
    # stored in float32, so what J0 still sees is that one rounding e (|e| ≤ u·|ΔW_rect| entrywise):
    # |J0 e| ≤ ‖J0‖₂ ‖e‖ ≤ sqrt(λ_max(J0 J0ᵀ)) · u · ‖ΔW_rect‖, doubled for the float64 projection's own residual.
    unit_roundoff = torch.finfo(torch.float32).eps / 2
    for name, layer in delta.layers.items():
        stored = delta.delta(name)
        leak = float(layer.jacobian.jvp(stored).norm())
        spectral = float(torch.linalg.eigvalsh(layer.jacobian.gram()).max().clamp_min(0).sqrt())
        assert leak <= 2 * spectral * unit_roundoff * float(stored.norm()), (name, leak)
    assert set(delta.report.rectification.replay_loss) == {"reference", "finetuned", "rectified"}


def test_user_target_modules_only_narrow_the_adapted_set(ws):
    cfg = fast_config(target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.1.self_attn.q_proj"])
    delta = JanusMerger(ws["base"], ws["lora"], ws["replay"], cfg, progress=False).run()
    assert delta.report.rectified_layers == ["model.layers.0.self_attn.q_proj"]  # k_proj is not adapted
    eff = load_effective_model(ws["base"], ws["lora"], progress=False)
    for name in delta.report.unrectified_layers:  # kept at their fine-tuned value
        torch.testing.assert_close(delta.delta(name), eff.delta(name), rtol=0, atol=1e-7)
        assert delta.layers[name].rectified is False


# ---- save_adapter ------------------------------------------------------------------------------------------
def reload_adapter(base_dir, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(base_dir), adapter_dir).eval()


def lora_delta(peft_model, name):
    module = peft_model.base_model.model.get_submodule(name)
    return module.get_delta_weight("default")


def test_full_rank_adapter_reproduces_delta_and_logits(ws, lora_result, tmp_path):
    out = lora_result.save_adapter(tmp_path / "full-rank", adapter_rank=10_000, progress=False)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and not cfg["use_rslora"] and not cfg["use_dora"]
    assert cfg["lora_alpha"] == cfg["r"] and cfg["alpha_pattern"] == cfg["rank_pattern"]
    assert cfg["base_model_name_or_path"] == ws["base"]
    reloaded = reload_adapter(ws["base"], out)
    for name in lora_result.layer_names:
        torch.testing.assert_close(lora_delta(reloaded, name), lora_result.delta(name), rtol=0, atol=1e-6)
    # logits of stock PEFT loading == base + ΔW_rect, built explicitly
    explicit = load_base(ws["base"])
    with torch.no_grad():
        for name in lora_result.layer_names:
            explicit.get_submodule(name).weight += lora_result.delta(name)
    torch.testing.assert_close(logits(reloaded, IDS), logits(explicit, IDS), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(lora_result.model, IDS), logits(explicit, IDS), rtol=0, atol=1e-5)
    report = MergeReport.load(os.path.join(out, REPORT_NAME))
    assert report.output_format == "adapter" and len(report.refactorization["layers"]) == len(lora_result.layers)
    assert all(s["kept_energy"] == pytest.approx(1.0) for s in report.refactorization["layers"])


@pytest.mark.parametrize("kind", ["dora", "embed-mts", "pissa"])
def test_other_kinds_save_as_plain_lora(ws, kind, tmp_path):
    delta = JanusMerger(ws["base"], ws[kind], ws["replay"], fast_config(), progress=False).run()
    out = delta.save_adapter(tmp_path / kind, adapter_rank=10_000, progress=False)
    reloaded = reload_adapter(ws["base"], out)
    torch.testing.assert_close(logits(reloaded, IDS), logits(delta.model, IDS), rtol=0, atol=1e-5)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["init_lora_weights"] is True and cfg["use_dora"] is False
    if kind == "embed-mts":
        assert cfg["modules_to_save"] == ["lm_head"]
        assert "model.embed_tokens" in delta.report.unrectified_layers


def test_same_and_auto_rank(ws, tmp_path):
    delta = JanusMerger(ws["base"], ws["rslora-patterns"], ws["replay"], fast_config(), progress=False).run()
    out = delta.save_adapter(tmp_path / "same", adapter_rank="same", progress=False)
    stats = {s["name"]: s for s in delta.report.refactorization["layers"]}
    reloaded = reload_adapter(ws["base"], out)
    for name, layer in delta.layers.items():
        assert stats[name]["rank"] == layer.own_rank == (2 if name.endswith("v_proj") else 4)
        u, s, vh = torch.linalg.svd(delta.delta(name).double(), full_matrices=False)
        k = layer.own_rank
        expected = (u[:, :k] * s[:k]) @ vh[:k]  # best rank-k approximation of ΔW_rect
        torch.testing.assert_close(lora_delta(reloaded, name).double(), expected, rtol=0, atol=1e-6)
        assert stats[name]["kept_energy"] == pytest.approx(float((s[:k] ** 2).sum() / (s**2).sum()))

    for spec in ("auto", 0.9):
        out = delta.save_adapter(tmp_path / f"auto-{spec}", adapter_rank=spec, adapter_energy=0.9, progress=False)
        cfg = json.load(open(os.path.join(out, "adapter_config.json")))
        for s in delta.report.refactorization["layers"]:
            sv = torch.linalg.svdvals(delta.delta(s["name"]).double())
            share = torch.cumsum(sv**2, 0) / (sv**2).sum()
            k = int((share < 0.9).sum()) + 1  # smallest k keeping 90 % of the energy
            assert s["rank"] == k and s["kept_energy"] >= 0.9
            assert cfg["rank_pattern"].get(s["name"], cfg["r"]) == k


def test_refine_gives_back_less_of_the_repair(ws, lora_result, tmp_path):
    out = lora_result.save_adapter(tmp_path / "refined", adapter_rank=2, refine=True, progress=False)
    reloaded = reload_adapter(ws["base"], out)
    stats = {s["name"]: s for s in lora_result.report.refactorization["layers"]}
    improved = 0
    for name, layer in lora_result.layers.items():
        s, jac = stats[name], layer.jacobian
        saved = lora_delta(reloaded, name).double()
        assert reloaded.base_model.model.get_submodule(name).lora_A["default"].weight.shape[0] == 2
        rect = lora_result.delta(name).double()
        # the reported numbers are ||J0 X|| / ||J0 ΔW|| of what was saved
        assert s["residual_refined"] == pytest.approx(float(jac.jvp(saved).norm()) / layer.jvp0_norm, rel=1e-4)
        assert s["leak_refined"] == pytest.approx(float(jac.jvp(saved - rect).norm()) / layer.jvp0_norm,
                                                  rel=1e-4, abs=1e-9)
        assert s["residual_truncated"] is not None and s["leak_refined"] <= s["leak_truncated"] + 1e-12
        improved += s["leak_refined"] < 0.9 * s["leak_truncated"]
    assert improved >= len(stats) // 2


def test_lora_bias_is_saved_in_the_adapter_and_base_biases_are_refused(ws, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = save_base(tmp_path / "base-with-bias", attention_bias=True, tokenizer=False)
    model = get_peft_model(load_base(base), LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True,
                                                       init_lora_weights=False))
    model.save_pretrained(tmp_path / "biased")
    delta = JanusMerger(base, tmp_path / "biased", ws["replay"], fast_config(), progress=False).run()
    assert not torch.equal(delta.model.model.layers[0].self_attn.q_proj.bias,
                           load_base(base).model.layers[0].self_attn.q_proj.bias)  # the bias update is kept
    # lora_bias: the adapter holds s·lora_B.bias (scaling 1 after re-factorization), at full rank the same model
    delta.save_adapter(tmp_path / "out", adapter_rank=16, progress=False)
    reloaded = PeftModel.from_pretrained(load_base(base), tmp_path / "out")
    torch.testing.assert_close(logits(reloaded, IDS), logits(delta.model, IDS), rtol=0, atol=1e-5)
    delta.save_full(tmp_path / "full")  # the full weights hold everything

    # bias="all" trains the base biases themselves, which a LoRA adapter cannot hold
    model = get_peft_model(load_base(base), LoraConfig(r=2, target_modules=["q_proj"], bias="all",
                                                       init_lora_weights=False))
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.bias.add_(0.1)
    model.save_pretrained(tmp_path / "base-biases")
    delta = JanusMerger(base, tmp_path / "base-biases", ws["replay"], fast_config(), progress=False).run()
    with pytest.raises(JanusError, match="biases.*save_full"):
        delta.save_adapter(tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()


def test_gpt2_conv1d_layers_round_trip(tmp_path):
    """GPT-2 stores Conv1D weights (d_in, d_out): ΔW is handled in (d_out, d_in) and saved with fan_in_fan_out."""
    from testing_utils import build_tiny, random_replay
    from peft import LoraConfig, get_peft_model

    build_tiny("gpt2").save_pretrained(tmp_path / "gpt2")
    lora = LoraConfig(r=2, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, init_lora_weights=False)
    get_peft_model(load_base(tmp_path / "gpt2"), lora).save_pretrained(tmp_path / "gpt2-lora")
    expected = state(peft_merged(tmp_path / "gpt2", tmp_path / "gpt2-lora"))
    eff = load_effective_model(tmp_path / "gpt2", tmp_path / "gpt2-lora", progress=False)
    for key, value in state(eff.model).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
    name = "transformer.h.0.attn.c_attn"
    assert list(eff.delta(name).shape) == list(expected[name + ".weight"].shape)  # native layout (16, 48)
    delta = JanusMerger(tmp_path / "gpt2", tmp_path / "gpt2-lora", random_replay(6), fast_config(),
                        progress=False).run()
    assert list(delta.delta(name).shape) == [48, 16]  # (d_out, d_in)
    out = delta.save_adapter(tmp_path / "out", adapter_rank=10_000, progress=False)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["fan_in_fan_out"] is True
    reloaded = reload_adapter(tmp_path / "gpt2", out)
    torch.testing.assert_close(logits(reloaded, IDS), logits(delta.model, IDS), rtol=0, atol=1e-5)


# ---- save_full and atomic outputs --------------------------------------------------------------------------
def test_save_full_is_sharded_like_the_base_and_loads(ws, lora_result, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = lora_result.save_full(tmp_path / "full")
    base_shards = [f for f in os.listdir(ws["base"]) if f.endswith(".safetensors")]
    out_shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(base_shards) > 1 and len(out_shards) == len(base_shards)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    for key, value in state(loaded).items():
        assert torch.equal(value, lora_result.model.state_dict()[key]), key
    assert AutoTokenizer.from_pretrained(out)("abc")["input_ids"] == load_tokenizer(ws["base"])("abc")["input_ids"]
    assert MergeReport.load(os.path.join(out, REPORT_NAME)).output_format == "full"


def test_outputs_are_atomic_and_never_overwritten_silently(lora_result, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(JanusError, match="already exists.*overwrite"):
        lora_result.save_adapter(target, progress=False)
    with pytest.raises(JanusError, match="already exists"):
        lora_result.save_full(target)
    assert os.listdir(target) == ["keep.txt"]
    lora_result.save_adapter(target, overwrite=True, progress=False)
    assert "keep.txt" not in os.listdir(target) and "adapter_model.safetensors" in os.listdir(target)
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left behind

    with pytest.raises(JanusError, match="rank"):  # a failure before writing leaves nothing behind
        lora_result.save_adapter(tmp_path / "bad", adapter_rank=0)
    assert not (tmp_path / "bad").exists()


# ---- bad inputs --------------------------------------------------------------------------------------------
def test_wrong_base_is_refused_by_name_and_by_shape(ws, tmp_path):
    other = save_base(tmp_path / "other-base", seed=3)
    with pytest.raises(JanusError) as err:
        load_effective_model(other, ws["lora"], progress=False)
    assert ws["base"] in str(err.value) and other in str(err.value) and "allow_base_mismatch" in str(err.value)
    eff = load_effective_model(other, ws["lora"], allow_base_mismatch=True, progress=False)  # same shapes: fine
    assert set(eff.layers) == set(load_effective_model(ws["base"], ws["lora"], progress=False).layers)

    wide = save_base(tmp_path / "wide-base", intermediate_size=32)
    with pytest.raises(JanusError, match=r"down_proj.*\(16, 24\).*\(16, 32\)"):
        load_effective_model(wide, ws["lora"], allow_base_mismatch=True, progress=False)


def test_missing_files_give_clear_errors(ws, tmp_path):
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    with pytest.raises(JanusError, match="no adapter_config.json"):
        load_effective_model(ws["base"], empty, progress=False)
    with pytest.raises(JanusError, match="looks like a full model"):
        load_effective_model(ws["base"], ws["base"], progress=False)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(ws["lora"], no_weights)
    os.remove(no_weights / "adapter_model.safetensors")
    with pytest.raises(JanusError, match="no weights"):
        load_effective_model(ws["base"], no_weights, progress=False)
    with pytest.raises(JanusError, match="does not exist"):
        load_effective_model(ws["base"], tmp_path / "nowhere" / "adapter", progress=False)
    with pytest.raises(JanusError, match="base model directory .* does not exist"):
        load_effective_model(tmp_path / "nowhere" / "base", ws["lora"], allow_base_mismatch=True, progress=False)


def test_empty_replay_is_refused_before_loading(ws, tmp_path):
    with pytest.raises(JanusError, match="replay is empty"):
        JanusMerger(ws["base"], ws["lora"], [], fast_config())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(JanusError, match="empty|no usable"):
        JanusMerger(ws["base"], ws["lora"], os.fspath(empty), fast_config(), progress=False).run()
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(JanusError, match="no usable sample"):
        JanusMerger(ws["base"], ws["lora"], blank, fast_config(), progress=False).run()


# ---- the Hub ----------------------------------------------------------------------------------------------
def test_base_and_adapter_by_repo_id_from_the_hub(ws, lora_result, tmp_path):
    from hub_server import LocalHub, patch_hub_clients
    from huggingface_hub import HfApi

    adapter_dir = tmp_path / "adapter-for-hub"
    shutil.copytree(ws["lora"], adapter_dir)
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "me/tiny-base"  # as if trained on the Hub model
    cfg_path.write_text(json.dumps(cfg))
    with LocalHub() as hub, patch_hub_clients(hub, tmp_path / "hf_home"):
        api = HfApi()
        for repo, folder in (("me/tiny-base", ws["base"]), ("me/tiny-lora", adapter_dir)):
            api.create_repo(repo)
            api.upload_folder(repo_id=repo, folder_path=folder)
        hub_result = JanusMerger("me/tiny-base", "me/tiny-lora", ws["replay"], fast_config(), progress=False).run()
        url = hub_result.push_to_hub("me/tiny-lora-janus", adapter_rank="same", progress=False)
        pushed = set(hub.list_files("me/tiny-lora-janus"))
        card = hub.read_file("me/tiny-lora-janus", "README.md").decode()
        with pytest.raises(JanusError, match="me/missing-adapter"):
            JanusMerger("me/tiny-base", "me/missing-adapter", ws["replay"], fast_config(), progress=False).run()
    for name in lora_result.layer_names:
        torch.testing.assert_close(hub_result.delta(name), lora_result.delta(name), rtol=0, atol=1e-6)
    assert {"adapter_config.json", "adapter_model.safetensors", REPORT_NAME, "README.md"} <= pushed
    assert "base_model: me/tiny-base" in card
    assert "me/tiny-lora-janus" in url
    assert hub_result.report.adapter == "me/tiny-lora"


def test_report_round_trips(lora_result, tmp_path):
    lora_result.report.save(tmp_path / "r.json")
    again = MergeReport.load(tmp_path / "r.json")
    assert again.to_dict() == json.loads(json.dumps(lora_result.report.to_dict()))
    assert "rectified" in again.summary()
    # the config the merger ran with: the one given, narrowed to the adapter's layers (tau=0 etc., not the defaults)
    ran = dataclasses.replace(fast_config(), target_modules=lora_result.layer_names, exclude_modules=None)
    assert JanusConfig.from_dict(again.rectification.config) == ran != JanusConfig()
