"""JanusMerger and ``hf-janus merge --load-in-8bit`` on a bitsandbytes LLM.int8 base (CPU kernels: bitsandbytes
>= 0.46).

A LoRA adapter trained on the 8-bit base is rectified against that base as it computes: the update loses the part
the replay's Jacobian (explicit, ``torch.func``, at the dequantized base) sees and keeps the rest; the result can
only be saved as an adapter, which stock ``PeftModel.from_pretrained`` loads on a freshly quantized base; the
command line gives what the Python API gives, and refuses to write over an existing output.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", minversion="0.46")

from merge_fixtures import text_rows, write_jsonl  # noqa: E402
from test_qlora import (  # noqa: E402, F401  (base_dir: the 4-bit tests' tiny base, a fixture)
    EXACT,
    QUANTIZATIONS,
    base_dir,
    dequantized_layers,
    effective,
    explicit_jacobians,
    lora_model,
    quantized_base,
    samples,
    train,
)

from hf_janus import JanusConfig, JanusError, JanusMerger, MergeReport  # noqa: E402
from hf_janus.cli import main  # noqa: E402
from hf_janus.publish.record_file import REPORT_NAME  # noqa: E402

REPLAY = samples(6, seed=2)
# The rectified update is in the null space of the model as it computes, which is that of the dequantized weights only
# up to the activations' rounding: LLM.int8 rounds every activation row to 1/127 of its absmax, a relative error of at
# most INT8_STEP = 1/254 per entry. The engine's Jacobian rows carry that noise from each int8 layer on the path (four
# in a block of the tiny model, two blocks), so its row space turns from the dequantized one by an angle of a few
# steps: the residual is allowed 8 steps of |J ΔW|, and what was removed may lie outside J's row space by the bf16
# captures' allowance, 0.15 of it (tests/real, tests/adapters/test_bf16_adapters.py).
INT8_STEP = 1 / 254
RESIDUAL_RATIO = 8 * INT8_STEP  # |J ΔW_rect| / |J ΔW| per layer
OUTSIDE_OF_REMOVED = 0.15  # |change outside J's row space| / |change|


def int8_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**QUANTIZATIONS["int8"])


@pytest.fixture(scope="module")
def int8_adapter(base_dir, tmp_path_factory):  # noqa: F811
    """A LoRA adapter trained (without JanusCallback) on the 8-bit base, saved as PEFT saves it."""
    root = tmp_path_factory.mktemp("int8-adapter")
    model = lora_model(base_dir, "int8")
    train(model, root, [])
    model.save_pretrained(root / "adapter")
    return str(root / "adapter")


@pytest.fixture(scope="module")
def int8_delta(base_dir, int8_adapter):  # noqa: F811
    return JanusMerger(base_dir, int8_adapter, REPLAY, EXACT, progress=False, quantization_config=int8_config()).run()


def peft_on_int8(base_dir, adapter):  # noqa: F811
    from peft import PeftModel

    return PeftModel.from_pretrained(quantized_base(base_dir, "int8"), adapter).eval()


def test_merger_removes_only_what_the_replay_constrains(base_dir, int8_adapter, int8_delta):  # noqa: F811
    report = int8_delta.report
    original = peft_on_int8(base_dir, int8_adapter)
    adapted = effective(original)  # {layer: dequantized base + ΔW}, as PEFT applies the adapter
    assert sorted(report.rectified_layers) == sorted(adapted) and report.unrectified_layers == []
    assert report.adapter_kind == "lora" and report.rectification.alphas == [1.0] and report.rectification.converged

    dequantized = dequantized_layers(original)
    theta0 = {name: dequantized[f"{name}.base_layer"] for name in adapted}
    jac = explicit_jacobians(base_dir, dequantized, theta0, REPLAY)
    for name, w0 in theta0.items():
        j = jac[name].reshape(len(REPLAY), -1)
        before = (adapted[name] - w0).reshape(-1)
        after = int8_delta.delta(name).double().reshape(-1)
        removed = before - after
        # the replay constrains this layer: rectifying changed its update by 2-10% (measured)
        assert float(removed.norm()) > 0.01 * float(before.norm()), name
        ratio = float((j @ after).norm() / (j @ before).norm())
        assert ratio < RESIDUAL_RATIO, f"{name}: |J ΔW_rect| / |J ΔW| = {ratio:.2e}"
        # and only there: what was removed lies in the row space of J, the rest of ΔW is kept
        basis = torch.linalg.qr(j.T).Q
        off = removed - basis @ (basis.T @ removed)
        assert float(off.norm()) < OUTSIDE_OF_REMOVED * float(removed.norm()), \
            f"{name}: {float(off.norm() / removed.norm()):.2e}"


def test_merger_output_is_an_adapter_stock_peft_loads_on_an_8bit_base(base_dir, int8_delta, tmp_path):  # noqa: F811
    with pytest.raises(JanusError, match="save_full.*quantized base.*save_adapter"):
        int8_delta.save_full(tmp_path / "full")
    assert not (tmp_path / "full").exists()
    # 64 = min(d_out, d_in): exact
    out = int8_delta.save_adapter(tmp_path / "rectified", adapter_rank=64, progress=False)

    reloaded = effective(peft_on_int8(base_dir, out))
    assert sorted(reloaded) == sorted(int8_delta.layer_names)
    for name, weight in reloaded.items():  # measured: 1.5e-8
        torch.testing.assert_close(weight, int8_delta.model.get_submodule(name).weight.double(), rtol=0, atol=1e-6)

    config = json.loads((tmp_path / "rectified" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == base_dir
    record = MergeReport.load(os.path.join(out, REPORT_NAME))
    assert record.output_format == "adapter" and record.rectified_layers == int8_delta.report.rectified_layers
    assert record.refactorization["adapter_rank"] == 64
    assert [s["kept_energy"] for s in record.refactorization["layers"]] == pytest.approx([1.0] * len(reloaded))


def test_cli_merge_with_load_in_8bit(base_dir, int8_adapter, tmp_path, capsys):  # noqa: F811
    replay = write_jsonl(tmp_path / "past.jsonl", text_rows(6))
    out = tmp_path / "out"
    common = ["merge", "--base", base_dir, "--adapter", int8_adapter, "--replay", replay, "--text-field", "text",
              "--tau", "0", "--compression-rank", "0", "--no-progress", "--load-in-8bit"]
    assert main([*common, "--output", str(tmp_path / "full"), "--format", "full"]) == 2
    assert "--format adapter" in capsys.readouterr().err and not (tmp_path / "full").exists()

    args = [*common, "--output", str(out), "--adapter-rank", "64"]
    assert main(args) == 0
    assert f"rectified adapter written to {out}" in capsys.readouterr().out
    record = MergeReport.load(out / REPORT_NAME)
    assert record.output_format == "adapter" and record.replay == replay and record.rectification.config["tau"] == 0

    # What the API gives with the 8-bit base (measured: 1.5e-8 apart): the flag reached the loader. Rectified against
    # the dense base instead, the update is projected with another Jacobian and differs by up to 3.8e-5.
    api = JanusMerger(base_dir, int8_adapter, replay, JanusConfig(tau=0.0, compression_rank=None), progress=False,
                      quantization_config=int8_config()).run()
    for name, weight in effective(peft_on_int8(base_dir, str(out))).items():
        torch.testing.assert_close(weight, api.model.get_submodule(name).weight.double(), rtol=0, atol=1e-6)

    written = {p: (out / p).read_bytes() for p in os.listdir(out)}
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == written


def test_an_8bit_layer_that_has_run_still_runs_after_it_is_dequantized(base_dir):  # noqa: F811
    """An 8-bit layer moves its scales from its weight into its state at its first forward; dequantizing it after
    that (JANUS reads θ0 and θ̂ at train end) must leave it able to run, with the same outputs."""
    from hf_janus.engine.quantized import dequantized_weight

    model = quantized_base(base_dir, "int8").eval()
    ids = torch.tensor([[1, 5, 9, 13, 2, 30]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt))
        dense = dequantized_weight(layer)
        after = model(input_ids=ids).logits
    assert dense.shape == (layer.out_features, layer.in_features)
    assert torch.equal(after, before)
