"""``JanusMerger`` / ``hf-janus merge`` with the repair after JANUS: ``--new-task-samples`` (what the adapter was
trained on) gives the gain it keeps, a plain LoRA's repair trains its own factors (other kinds the dense weights, and
the log says why), the output stays an adapter, and without them the JANUS point is kept and the record has no
repair."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from merge_fixtures import VOCAB, fast_config, load_base, save_base, text_rows, train_adapter, write_jsonl
from testing_utils import held_out, random_replay

from hf_janus import JanusMerger
from hf_janus.errors import JanusError
from hf_janus.cli import main
from hf_janus.publish.record_file import REPORT_NAME

FAST = ["--tau", "0", "--compression-rank", "0", "--no-progress"]
REPAIR = ["--distill-steps", "4", "--distill-lr", "0.01", "--keep-gain", "0.05"]


def _adapter_training_rows(seed: int = 0) -> list[dict]:
    """What :func:`merge_fixtures.train_adapter` trains on (twice over: the repair holds out every eighth)."""
    gen = torch.Generator().manual_seed(seed + 7)
    data = torch.randint(0, VOCAB, (6, 10), generator=gen).tolist()
    return [{"input_ids": row, "labels": row} for row in data] * 2


def _saved_inputs(tmp_path) -> tuple[str, str, str, str]:
    """A tiny base, a LoRA trained on it, a replay file and the adapter's training samples as a file."""
    base = save_base(tmp_path / "base")
    lora = train_adapter(base, tmp_path / "lora", "lora", steps=20, lr=5e-2)
    replay = write_jsonl(tmp_path / "replay.jsonl", text_rows(16))
    new_task = write_jsonl(tmp_path / "new_task.jsonl", _adapter_training_rows())
    return base, lora, replay, new_task


def test_merge_repairs_with_the_adapters_training_samples_and_writes_an_adapter(tmp_path, caplog):
    base, lora, replay, new_task = _saved_inputs(tmp_path)

    out = tmp_path / "repaired"
    assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--new-task-samples", new_task,
                 "--output", str(out), *REPAIR, *FAST]) == 0
    record = json.loads((out / REPORT_NAME).read_text())
    assert record["repair"]["steps"] == 4 and record["repair"]["validation_samples"]["new_task"] == 1
    assert record["repair"]["trained"] == "the adapter's lora_A and lora_B"
    assert os.path.exists(out / "adapter_config.json")
    card = (out / "README.md").read_text()
    assert "repair after JANUS" in card and "the adapter's lora\\_A and lora\\_B" in card

    out = tmp_path / "without"
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--output", str(out), *REPAIR,
                     *FAST]) == 0
    skipped = json.loads((out / REPORT_NAME).read_text())["repair"]
    assert skipped["chosen"] is None and "no new-task samples" in skipped["reason"]
    assert "repair after JANUS" in (out / "README.md").read_text()  # the card says what was done instead
    assert "no new-task samples" in caplog.text


def test_merge_repairs_a_qlora_adapter_in_its_factors(tmp_path):
    """On a 4-bit base the adapted layers are dense stand-ins of the quantized ones: the adapter loaded onto them
    trains its factors (the distilled point moves away from the JANUS point) and the output is an adapter on the
    quantized base."""
    pytest.importorskip("bitsandbytes")
    base, lora, replay, new_task = _saved_inputs(tmp_path)
    out = tmp_path / "repaired"
    assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--new-task-samples", new_task,
                 "--output", str(out), "--load-in-4bit", *REPAIR, *FAST]) == 0
    repair = json.loads((out / REPORT_NAME).read_text())["repair"]
    assert repair["trained"] == "the adapter's lora_A and lora_B"
    assert repair["validation"]["trained"]["new_task_loss"] != repair["validation"]["janus"]["new_task_loss"]
    assert os.path.exists(out / "adapter_config.json")


FACTOR_REPAIR = dict(distill_steps=8, distill_lr=1e-2, keep_gain=0.05, replay_batch_size=4, new_task_batch_size=2)


@pytest.mark.parametrize("kind", ["rslora-patterns", "embed-mts"])
def test_a_saved_loras_repair_trains_its_factors_and_leaves_the_point_its_figures_were_taken_at(tmp_path, kind):
    """rsLoRA with rank and alpha patterns (PEFT's own scaling per layer), and a LoRA that also adapts the
    embeddings and fully trains the head: the update of each rectified layer stays within its rank, the model is at
    θ0 + that update, the validation figures are that model's, and the adapter saved at the same rank loads back as
    that model (the embeddings and the head as trained)."""
    from peft import PeftModel

    base = save_base(tmp_path / "base")
    lora = train_adapter(base, tmp_path / "lora", kind, steps=20, lr=5e-2)
    replay, new_task = random_replay(24, vocab=VOCAB), _adapter_training_rows()
    config = fast_config(**FACTOR_REPAIR)
    delta = JanusMerger(base, lora, replay, config, progress=False, new_task_samples=new_task).run()
    repair = delta.report.rectification.repair
    assert repair.trained == "the adapter's lora_A and lora_B" and repair.chosen is not None
    new_loss, replay_nll, agreement = held_out(delta.model, replay, new_task, config.replay_batch_size,
                                               config.new_task_batch_size)
    chosen = repair.validation["chosen"]
    assert chosen.new_task_loss == pytest.approx(new_loss, rel=1e-5)
    assert chosen.replay_nll == pytest.approx(replay_nll, rel=1e-5)
    assert chosen.replay_agreement == pytest.approx(agreement)
    theta0, ranks = load_base(base).state_dict(), {"q_proj": 4, "v_proj": 2, "down_proj": 4}
    weights = delta.model.state_dict()
    rectified = [name for name in delta.layer_names if delta.layers[name].rectified]
    assert rectified
    for name in rectified:
        update = delta.delta(name)
        assert torch.linalg.matrix_rank(update) <= ranks[name.rsplit(".", 1)[-1]], name
        assert torch.allclose(weights[name + ".weight"], theta0[name + ".weight"] + update, atol=1e-6), name
    out = delta.save_adapter(tmp_path / "out", adapter_rank="same")
    reloaded = PeftModel.from_pretrained(load_base(base), out).merge_and_unload().state_dict()
    finetuned = PeftModel.from_pretrained(load_base(base), lora).merge_and_unload().state_dict()
    for key, value in weights.items():
        assert torch.allclose(reloaded[key], value, atol=1e-5), key
        if not any(key == name + ".weight" for name in rectified):
            assert torch.allclose(value, finetuned[key], atol=1e-6), key  # what JANUS leaves stays as trained


def test_a_dora_adapters_repair_trains_the_dense_weights_and_says_why(tmp_path, caplog):
    base = save_base(tmp_path / "base")
    dora = train_adapter(base, tmp_path / "dora", "dora", steps=20, lr=5e-2)
    with caplog.at_level(logging.INFO, logger="hf_janus"):
        delta = JanusMerger(base, dora, random_replay(24, vocab=VOCAB), fast_config(**FACTOR_REPAIR),
                            progress=False, new_task_samples=_adapter_training_rows()).run()
    assert delta.report.rectification.repair.trained == "the target layers' weights"
    assert "dense weights, not the adapter's factors: a dora adapter" in caplog.text


def test_an_interrupted_factor_repair_leaves_the_model_as_janus_left_it(tmp_path):
    """Ctrl-C in the middle of the repair in the adapter's factors: no PEFT wrapper is left and every adapted layer
    holds what it held before (the JANUS point, θ̂ elsewhere), whatever the repair had written by then."""
    from hf_janus.adapters.saved.effective import load_effective_model
    from hf_janus.adapters.saved.factor_repair import repair_in_factors
    from hf_janus.engine.rectifier import Rectifier, WeightSource

    base, lora, _, _ = _saved_inputs(tmp_path)
    effective = load_effective_model(base, lora, progress=False)
    targets = effective.linear_layers
    rectifier = Rectifier(effective.model, WeightSource(dict(effective.reference), finetuned=dict(effective.finetuned)),
                          random_replay(24, vocab=VOCAB), fast_config(**FACTOR_REPAIR, target_modules=targets),
                          progress=False, keep_reference_factors=True, new_task=_adapter_training_rows(),
                          defer_repair=True)
    result = rectifier.run()
    before = {k: v.clone() for k, v in effective.model.state_dict().items()}

    class Interrupted:
        def repair(self, space):
            space.write([torch.full_like(t, 0.5) for t in space.trained_tensors()])  # half-way through
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repair_in_factors(effective, Interrupted(), result)
    after = effective.model.state_dict()
    assert set(after) == set(before)  # no lora_A/lora_B, no wrapper left
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_the_gain_is_measured_on_the_new_tasks_validation_samples_when_given(tmp_path):
    """``--new-task-validation`` (a Trainer's eval_dataset for the callback): the repair fits every new-task sample
    and measures the gain on the validation file; without the new-task samples it is refused, naming them."""
    base, lora, replay, new_task = _saved_inputs(tmp_path)
    validation = write_jsonl(tmp_path / "validation.jsonl", _adapter_training_rows(seed=3)[:3])
    out = tmp_path / "repaired"
    assert main(["merge", "--base", base, "--adapter", lora, "--replay", replay, "--new-task-samples", new_task,
                 "--new-task-validation", validation, "--output", str(out), *REPAIR, *FAST]) == 0
    repair = json.loads((out / REPORT_NAME).read_text())["repair"]
    assert repair["gain_measured_on"] == "the new task's validation samples"
    assert repair["validation_samples"]["new_task"] == 3
    with pytest.raises(JanusError, match="give those too"):
        JanusMerger(base, lora, replay, new_task_validation=validation)


def test_a_saved_loras_factor_repair_on_a_bf16_base(tmp_path):
    """As users load a base: in bf16. The factors train in float32 (PEFT keeps adapters there), the layers end at
    θ0 + the chosen update rounded once to bf16, the figures are those of the model left, and the saved adapter
    holds the update in float32."""
    base = save_base(tmp_path / "base")
    lora = train_adapter(base, tmp_path / "lora", "lora", steps=20, lr=5e-2)
    replay, new_task = random_replay(24, vocab=VOCAB), _adapter_training_rows()
    config = fast_config(**FACTOR_REPAIR)
    delta = JanusMerger(base, lora, replay, config, torch_dtype=torch.bfloat16, progress=False,
                        new_task_samples=new_task).run()
    repair = delta.report.rectification.repair
    assert repair.trained == "the adapter's lora_A and lora_B" and repair.chosen is not None
    weights = delta.model.state_dict()
    theta0 = {k: v.to(torch.bfloat16) for k, v in load_base(base).state_dict().items()}
    for name in delta.layer_names:
        update = delta.delta(name)
        assert update.dtype == torch.float32 and torch.linalg.matrix_rank(update) <= 4, name
        expected = (theta0[name + ".weight"].float() + update).to(torch.bfloat16)
        assert torch.equal(weights[name + ".weight"], expected), name
    new_loss, replay_nll, _ = held_out(delta.model, replay, new_task, config.replay_batch_size,
                                       config.new_task_batch_size)
    assert repair.validation["chosen"].new_task_loss == pytest.approx(new_loss, rel=1e-3)
    assert repair.validation["chosen"].replay_nll == pytest.approx(replay_nll, rel=1e-3)
