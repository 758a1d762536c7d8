"""The engine's public result (``Rectifier.result``) and the one rule that narrows adapted layers."""

from __future__ import annotations

import pytest
import torch
from testing_utils import random_replay

from hf_janus import JanusConfig, LayerResult, RectificationResult
from hf_janus.engine.layers import select_layers
from hf_janus.engine.rectifier import Rectifier
from hf_janus.errors import JanusError


def test_result_holds_theta0_finetuned_and_rectified_per_layer(tuned_llama):
    model, reference = tuned_llama
    finetuned = {k: v.clone() for k, v in model.state_dict().items()}
    rectifier = Rectifier(model, reference, random_replay(6), JanusConfig(compression_rank=4, replay_batch_size=3,
                                                                          max_steps=3),
                          progress=False, keep_reference_factors=True)
    report = rectifier.run().report
    result = rectifier.result
    assert isinstance(result, RectificationResult) and result.report is report
    assert list(result.layers) == [s.name for s in report.layers]
    for name, layer in result.layers.items():
        assert isinstance(layer, LayerResult)
        key = name + ".weight"
        torch.testing.assert_close(layer.reference, reference[key].float(), rtol=0, atol=0)
        torch.testing.assert_close(layer.finetuned(), finetuned[key].float(), rtol=0, atol=0)
        torch.testing.assert_close(layer.rectified, model.state_dict()[key].float(), rtol=0, atol=0)
        torch.testing.assert_close(layer.delta(), finetuned[key].float() - reference[key].float())
        torch.testing.assert_close(layer.rect_delta(), model.state_dict()[key].float() - reference[key].float())
        # ||J0 ΔW||: the denominator of the report's residual ||J0 ΔW_rect|| / ||J0 ΔW||.
        stats = next(s for s in report.layers if s.name == name)
        rect_norm = float(layer.jacobian.jvp(layer.rect_delta()).norm())
        assert stats.residual == pytest.approx(rect_norm / layer.jvp0_norm(), rel=1e-6, abs=1e-9)
    result.release()


def test_result_without_kept_factors_has_no_jacobian(tuned_llama):
    model, reference = tuned_llama
    rectifier = Rectifier(model, reference, random_replay(4), JanusConfig(compression_rank=4, tau=0.0), progress=False)
    assert rectifier.result is None  # only a finished run has one
    rectifier.run()
    layer = next(iter(rectifier.result.layers.values()))
    assert layer.jacobian is None and layer.jvp0_norm() is None


def test_select_layers_only_narrows():
    names = ["m.layers.0.q_proj", "m.layers.0.v_proj", "m.layers.1.q_proj"]
    assert select_layers(names) == names
    assert select_layers(names, ["q_proj"]) == ["m.layers.0.q_proj", "m.layers.1.q_proj"]
    assert select_layers(names, r".*\.0\..*") == names[:2]
    assert select_layers(names, "all-linear", ["v_proj"]) == ["m.layers.0.q_proj", "m.layers.1.q_proj"]
    # k_proj: not adapted
    assert select_layers(names, ["q_proj", "k_proj"]) == ["m.layers.0.q_proj", "m.layers.1.q_proj"]
    with pytest.raises(JanusError, match=r"none of the adapted layers \(m.layers.0.q_proj, .*\) is selected by "
                                         r"target_modules=\['o_proj'\]"):
        select_layers(names, ["o_proj"])
