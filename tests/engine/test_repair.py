"""The repair after JANUS (``JanusConfig.distill_steps``): it holds out every eighth sample, keeps the share of the
new task's gain it is asked to, says which point it took and why with figures an independent computation gives, is
bit-for-bit the JANUS point where it must be, refuses what it cannot do before any work, and leaves θ̂ when
interrupted."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from testing_utils import REPAIR_CONFIG, build_tiny, fine_tune, fine_tune_samples, held_out, random_replay

from hf_janus import JanusConfig, JanusError, RectificationReport, rectify
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.layers import resolve_target_modules
from hf_janus.engine.memory_plan import REPAIR_REFERENCE_CACHE_BYTES
from hf_janus.engine.repair import (MOVES, SCHEDULES, VALIDATION_EVERY, Repair, counted_logits, keeps_positions,
                                   split_validation)
from hf_janus.engine.repair_space import WeightSpace
from hf_janus.replay.prepare import IGNORE_INDEX, loss_targets, prepare_replay, rebatch

FAST = {k: v for k, v in REPAIR_CONFIG.items() if k in ("compression_rank", "replay_batch_size", "tau")}
REPAIR = {k: v for k, v in REPAIR_CONFIG.items() if k not in FAST}


def new_task_samples() -> list[dict]:
    return fine_tune_samples()


@pytest.fixture
def models():
    finetuned = build_tiny("llama")
    theta0 = fine_tune(finetuned)
    return finetuned, theta0


def run(models, **overrides):
    finetuned, theta0 = models
    model = copy.deepcopy(finetuned)
    new_task = overrides.pop("new_task", new_task_samples())
    validation = overrides.pop("new_task_validation", None)
    report = rectify(model, theta0, random_replay(24), JanusConfig(**FAST, **overrides), progress=False,
                     new_task=new_task, new_task_validation=validation)
    return model, report


def held_out_figures(model, replay, new_task, split=True):
    batch_size = JanusConfig(**FAST, **REPAIR).new_task_batch_size
    return held_out(model, replay, new_task, FAST["replay_batch_size"], batch_size, split=split)


def test_every_eighth_sample_across_batches_is_held_out():
    batches = prepare_replay(random_replay(20), 6, group_by_length=False)
    train, held = split_validation(batches)
    assert sum(len(b["input_ids"]) for b in held) == 20 // VALIDATION_EVERY
    rows = torch.cat([b["input_ids"][:, :4] for b in batches])
    assert torch.equal(torch.cat([b["input_ids"][:, :4] for b in held]), rows[VALIDATION_EVERY - 1::VALIDATION_EVERY])
    assert sum(len(b["input_ids"]) for b in train) == 20 - 2
    train, held = split_validation(prepare_replay(random_replay(40), 6, group_by_length=False), most=3)
    assert sum(len(b["input_ids"]) for b in held) == 3 and sum(len(b["input_ids"]) for b in train) == 37


def test_the_chosen_point_keeps_the_gain_and_its_figures_are_the_models(models):
    model, report = run(models, **REPAIR)
    repair = report.repair
    assert repair is not None and repair.steps == REPAIR["distill_steps"]
    assert set(repair.validation) >= {"reference", "finetuned", "janus", "trained", "chosen"}
    assert repair.validation_samples == {"replay": 3, "new_task": 2}
    assert repair.chosen.startswith("b=") and repair.b == float(repair.chosen[2:])
    assert repair.gain_kept("chosen") >= REPAIR["keep_gain"]
    chosen = repair.validation["chosen"]
    new_loss, replay_nll, agreement = held_out_figures(model, random_replay(24), new_task_samples())
    assert chosen.new_task_loss == pytest.approx(new_loss, rel=1e-5)  # the model holds the point it reports
    assert chosen.replay_nll == pytest.approx(replay_nll, rel=1e-5)
    assert chosen.replay_agreement == pytest.approx(agreement)
    assert "farthest move toward θ0" in repair.reason
    assert "repair after JANUS" in report.summary() and repair.chosen in report.summary()
    assert RectificationReport.from_dict(report.to_dict()).repair == repair  # survives the record
    assert "repair" in report.memory_plan["phases"]  # its copies of the layers were planned before any work


def test_the_other_parameters_fine_tuning_changed_move_with_the_layers(models):
    """A full fine-tune also changed the embeddings, the norms and the head, which JANUS leaves at θ̂: the repair
    distils them toward θ0 with the target layers and moves them back along the same line; a parameter fine-tuning
    did not change, or whose θ0 the reference does not hold, keeps its fine-tuned value bit for bit."""
    finetuned, theta0 = models
    targets = {f"{name}.weight" for name in resolve_target_modules(finetuned)}
    changed = sorted(name for name, p in finetuned.named_parameters()
                     if name not in targets and not torch.equal(p, theta0[name]))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(changed)
    model, report = run(models, **REPAIR)
    assert sorted(report.repair.outside_parameters) == changed and report.repair.b < 1
    for name, param in model.named_parameters():
        if name in changed:
            assert not torch.equal(param, finetuned.get_parameter(name)), name
            assert not torch.equal(param, theta0[name]), name
        elif name not in targets:
            assert torch.equal(param, finetuned.get_parameter(name)), name

    layers_only = {name: theta0[name] for name in targets}
    model, report = run((finetuned, layers_only), **REPAIR)
    assert report.repair.outside_parameters == []
    for name, param in model.named_parameters():
        if name not in targets:
            assert torch.equal(param, finetuned.get_parameter(name)), name


def test_the_bisection_takes_the_point_a_walk_of_the_whole_grid_takes(models):
    """The line is bisected rather than walked (about seven points scored instead of a hundred); where the gain falls
    toward θ0, as here, it takes the farthest move that keeps the gain, as a walk of every move finds it apart from
    the engine: θ_T rebuilt from the weights the model holds (the target layers and the other parameters fine-tuning
    changed, which move with them), each move scored on the held-out slices."""
    finetuned, theta0 = models
    model, report = run(models, **REPAIR)
    b = report.repair.b
    assert b is not None
    figures = report.repair.validation
    floor = figures["reference"].new_task_loss - REPAIR["keep_gain"] * (
        figures["reference"].new_task_loss - figures["finetuned"].new_task_loss)
    walk = {}
    for move in MOVES:
        point = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in point.named_parameters():
                if not torch.equal(p, finetuned.get_parameter(name)):  # a moved parameter: θ0 + move (θ_T − θ0)
                    p.copy_(theta0[name] + move / b * (p - theta0[name]))
        new_loss, replay_nll, _ = held_out_figures(point, random_replay(24), new_task_samples())
        walk[move] = (new_loss, replay_nll)
    feasible = [move for move in MOVES if walk[move][0] <= floor]
    assert 0 < len(feasible) < len(MOVES) and feasible == list(MOVES[:len(feasible)])  # every move down to one b
    assert feasible[-1] == b


def test_given_validation_samples_measure_the_gain_and_every_new_task_sample_is_fitted(models):
    validation = new_task_samples()[:5]
    model, report = run(models, **REPAIR, new_task_validation=validation)
    repair = report.repair
    assert repair.validation_samples["new_task"] == 5
    assert repair.gain_measured_on == "the new task's validation samples"
    new_loss, _, _ = held_out_figures(model, random_replay(24), validation, split=False)
    assert repair.validation["chosen"].new_task_loss == pytest.approx(new_loss, rel=1e-5)
    with pytest.raises(JanusError, match="new-task validation samples are empty: give some, or none"):
        run(models, **REPAIR, new_task_validation=[])


def test_when_no_point_keeps_the_gain_the_janus_point_is_kept(models):
    plain, _ = run(models)
    model, report = run(models, **{**REPAIR, "keep_gain": 1.0})
    assert report.repair.chosen == "janus"
    assert "no move toward θ0 from the distilled point keeps 100%" in report.repair.reason
    assert report.repair.gain_kept("janus") < 1.0
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)


def test_no_steps_and_no_new_task_are_the_janus_point_bit_for_bit(models, caplog):
    plain, plain_report = run(models)
    off, off_report = run(models, distill_steps=0)
    assert off_report.repair is None
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        skipped, skipped_report = run(models, distill_steps=5, new_task=None)
    assert "no new-task samples" in caplog.text
    # the record and the card say that the repair asked for was not run, and why
    assert skipped_report.repair.chosen is None and "no new-task samples" in skipped_report.repair.reason
    assert "repair after JANUS: none (no new-task samples" in skipped_report.summary()
    for key, value in plain.state_dict().items():
        assert torch.equal(off.state_dict()[key], value) and torch.equal(skipped.state_dict()[key], value)


def test_a_diverging_distillation_keeps_the_janus_point(models, caplog):
    plain, _ = run(models)
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        model, report = run(models, distill_steps=6, distill_lr=1e30)
    assert report.repair.chosen == "janus" and "diverged" in report.repair.reason
    assert "diverged" in caplog.text
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)


def test_an_interrupted_distillation_leaves_the_fine_tuned_weights(models):
    finetuned, theta0 = models
    model = copy.deepcopy(finetuned)
    model.requires_grad_(False)  # only the distillation turns the target weights' gradients on

    def interrupt(module, args):
        if module.model.layers[0].mlp.up_proj.weight.requires_grad:
            raise KeyboardInterrupt

    model.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        rectify(model, theta0, random_replay(24), JanusConfig(**FAST, **REPAIR), progress=False,
                new_task=new_task_samples())
    for key, value in finetuned.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("new_task, match", [
    (new_task_samples()[:7], "too few samples"),
    ([{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}] * 8, "no token that carries loss"),
    ([{"input_ids": [1, 2, 999], "labels": [1, 2, 999]}] * 8, "new-task.*999.*vocabulary"),
])
def test_what_the_repair_cannot_use_is_refused_before_any_work(models, new_task, match):
    finetuned, theta0 = models
    model = copy.deepcopy(finetuned)
    with pytest.raises(JanusError, match=match):
        Rectifier(model, theta0, random_replay(24), JanusConfig(**FAST, **REPAIR), progress=False,
                  new_task=new_task)  # refused by the constructor: no capture has run
    for key, value in finetuned.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)


def test_a_bfloat16_model_is_repaired(models):
    finetuned, theta0 = models
    model = copy.deepcopy(finetuned).to(torch.bfloat16)
    report = rectify(model, {k: v.to(torch.bfloat16) for k, v in theta0.items()}, random_replay(24),
                     JanusConfig(**FAST, **REPAIR), progress=False, new_task=new_task_samples())
    figures = report.repair.validation["chosen"]
    assert all(torch.isfinite(torch.tensor(v)) for v in (figures.new_task_loss, figures.replay_nll))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_training_passes_under_autocast_train_the_point_float32_passes_train(models):
    """With ``repair_autocast`` the training passes run in bf16 autocast and the rest at the weights' precision:
    θ0's, θ̂'s and the JANUS point's figures are bit for bit a float32 run's, and the trained point's figures
    differ from its by bf16 rounding only."""
    finetuned, theta0 = models
    reports = []
    for autocast in (None, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        rectifier = Rectifier(copy.deepcopy(finetuned), theta0, random_replay(24), JanusConfig(**FAST, **REPAIR),
                              progress=False, new_task=new_task_samples(), repair_autocast=autocast)
        reports.append(rectifier.run().report.repair)
    plain, mixed = reports
    assert plain.autocast_dtype is None and mixed.autocast_dtype == "bfloat16"
    for point in ("reference", "finetuned", "janus"):
        assert mixed.validation[point] == plain.validation[point], point
    trained, reference = mixed.validation["trained"], plain.validation["trained"]
    assert trained != reference
    assert trained.new_task_loss == pytest.approx(reference.new_task_loss, rel=2e-2)
    assert trained.replay_nll == pytest.approx(reference.replay_nll, rel=2e-2)


class _WithAnUnreachedTensor(WeightSpace):
    """The target layers' weights and a tensor no forward uses (as a layer that keeps its weight frozen)."""

    def __init__(self, layers):
        super().__init__(layers)
        self.unreached = torch.nn.Parameter(torch.zeros(3))

    def points(self, device):
        return tuple(point + [torch.zeros(3)] for point in super().points(device))

    def trained_tensors(self):
        return super().trained_tensors() + [self.unreached]

    def tensor_names(self):
        return super().tensor_names() + ["frozen.weight"]

    def gradient_layouts(self):
        return super().gradient_layouts() + [lambda g: g]

    def write(self, point):
        super().write(point[:-1])
        self.unreached.data.copy_(point[-1])


def test_a_tensor_the_loss_sends_no_gradient_to_is_refused_not_left_untrained(models):
    """A tensor the forward does not reach would stay where it is while the report said it trained: the first step
    refuses it by name."""
    finetuned, theta0 = models
    rectifier = Rectifier(copy.deepcopy(finetuned), theta0, random_replay(24), JanusConfig(**FAST, **REPAIR),
                          progress=False, new_task=new_task_samples(), defer_repair=True)
    rectifier.run()
    assert rectifier.result.report.repair is None  # deferred: the caller runs it
    with pytest.raises(JanusError, match="no gradient for 'frozen.weight'"):
        rectifier.repair(_WithAnUnreachedTensor(rectifier.layers))


@pytest.mark.parametrize("field, value", [("distill_steps", -1), ("keep_gain", 0.0), ("keep_gain", 1.5),
                                          ("distill_lr", 0.0), ("new_task_weight", -1.0),
                                          ("new_task_batch_size", 0), ("distill_schedule", "step"),
                                          ("distill_replay_batch_size", 0)])
def test_invalid_repair_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"JanusConfig.{field}"):
        JanusConfig(**{field: value})


def test_the_repairs_learning_rate_follows_the_fine_tunes_unless_set():
    """Unset, the distillation trains at a tenth of the fine-tune's learning rate where it is known (the callback
    gives the Trainer's), else at DEFAULT_DISTILL_LR; a rate the user set is kept."""
    from hf_janus.engine.config import DEFAULT_DISTILL_LR

    unset = JanusConfig(distill_steps=4)
    assert unset.distill_lr is None and unset.repair_lr == DEFAULT_DISTILL_LR
    assert unset.after_fine_tune(2e-4).repair_lr == pytest.approx(2e-5)
    assert unset.after_fine_tune(None) is unset and unset.after_fine_tune(0.0) is unset
    given = JanusConfig(distill_steps=4, distill_lr=3e-6)
    assert given.after_fine_tune(2e-4).repair_lr == 3e-6
    assert JanusConfig.from_dict(unset.after_fine_tune(2e-4).to_dict()).distill_lr == pytest.approx(2e-5)


def _rows(batches):
    """Each row's attended tokens, their positions and the targets it counts, in the batches' order."""
    out = []
    for batch in batches:
        targets = loss_targets(batch)
        for ids, mask, counted in zip(batch["input_ids"], batch["attention_mask"], targets):
            where = mask.nonzero()[:, 0]
            out.append((ids[where].tolist(), where.tolist(),
                        [(int(t), int(v)) for t, v in enumerate(counted) if v != IGNORE_INDEX]))
    return out


def test_rebatching_keeps_every_rows_tokens_positions_and_targets():
    """The replay batched anew for the distillation's steps: the rows in their order, each with its attended tokens
    at their positions (a left-padded batch's too) and the targets it counted (a label-less batch's every token, a
    label right after the last attended token), cut at the new size and padded no wider than a row needs."""
    samples = [{**s, "labels": [IGNORE_INDEX, IGNORE_INDEX, *s["input_ids"][2:]]} for s in random_replay(11)]
    batches = prepare_replay(samples, 4)
    left = {k: v.clone() for k, v in batches[0].items()}  # the first batch left-padded, without labels
    for key in ("input_ids", "attention_mask"):
        for row in range(len(left[key])):
            n = int(left["attention_mask"][row].sum())
            left[key][row] = torch.roll(batches[0][key][row], left[key].shape[1] - n)
    del left["labels"]
    given = [left, *batches[1:]]
    longest = int(given[1]["attention_mask"].sum(-1).argmax())
    # its last token made a pad that keeps its label, right after the last attended token: it is still counted
    given[1]["attention_mask"][longest, -1] = 0
    assert given[1]["labels"][longest, -1] != IGNORE_INDEX
    for size in (1, 3, 5, 16):
        merged = rebatch(given, size)
        assert [len(b["input_ids"]) for b in merged] == [min(size, 11 - i) for i in range(0, 11, size)]
        assert _rows(merged) == _rows(given), size
    widest = max(int(b["input_ids"].shape[1]) for b in given)
    assert rebatch(batches, 2)[0]["input_ids"].shape[1] < widest  # the shortest rows, grouped by length


def test_the_distillation_takes_its_own_replay_batch_size(models):
    """The distillation's replay batches are JANUS's rows batched anew at distill_replay_batch_size, whatever JANUS's
    replay_batch_size; the held-out slice is the same samples either way, and the report says the size."""
    finetuned, theta0 = models
    held = []
    for size in (3, 8):
        config = JanusConfig(**FAST, **{**REPAIR, "distill_replay_batch_size": size})
        rectifier = Rectifier(copy.deepcopy(finetuned), theta0, random_replay(24), config, progress=False,
                              new_task=new_task_samples())
        sizes = [len(b["input_ids"]) for b in rectifier.repair_batches]
        assert sizes == [min(size, 24 - i) for i in range(0, 24, size)]
        assert _rows(rectifier.repair_batches) == _rows(rectifier.batches)
        held.append(_rows(split_validation(rectifier.repair_batches)[1]))
    assert held[0] == held[1]
    assert run(models, **{**REPAIR, "distill_replay_batch_size": 3})[1].repair.replay_batch_size == 3


def test_the_schedules_start_at_the_rate_and_the_decaying_ones_end_near_zero():
    """Every schedule runs its first step at ``distill_lr``; the decaying ones fall to 0 at the end of the run (their
    last step, at ``(n - 1) / n`` of it, still moves) and are halfway at its middle."""
    from hf_janus.engine.config import DISTILL_SCHEDULES

    assert set(SCHEDULES) == set(DISTILL_SCHEDULES)
    for name, factor in SCHEDULES.items():
        assert factor(0.0) == 1.0, name
    assert SCHEDULES["constant"](0.99) == 1.0
    for name in ("linear", "cosine"):
        assert SCHEDULES[name](0.5) == pytest.approx(0.5) and SCHEDULES[name](1.0) == pytest.approx(0.0)
        assert 0.0 < SCHEDULES[name](7 / 8) < SCHEDULES[name](3 / 4) < 1.0


def test_a_decaying_schedule_takes_its_first_step_at_the_rate_and_then_slows(models):
    """One step is the same point, bit for bit, whatever the schedule (its first step runs at the full rate); over
    more steps a decaying schedule trains to another point; the report, its summary and the record say which
    schedule ran."""
    trained = {}
    for steps in (1, 12):
        for schedule in ("constant", "linear", "cosine"):
            model, report = run(models, **{**REPAIR, "distill_steps": steps, "distill_schedule": schedule})
            assert report.repair.schedule == schedule and f"{schedule}," in report.summary()
            assert RectificationReport.from_dict(report.to_dict()).repair.schedule == schedule
            trained[steps, schedule] = report.repair.validation["trained"]
    assert trained[1, "linear"] == trained[1, "constant"] == trained[1, "cosine"]
    assert trained[12, "linear"] != trained[12, "constant"] and trained[12, "cosine"] != trained[12, "constant"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_head_at_the_counted_tokens_gives_the_full_forwards_logits(models, dtype):
    """The repair runs the output head only where a token carries loss (``logits_to_keep``); the logits it gets are
    the full forward's at those tokens, in the same order, as are the targets."""
    model = models[0].to(dtype)
    assert keeps_positions(model)
    batch = prepare_replay(new_task_samples()[:3] + random_replay(5), 8)[0]
    batch["labels"][0, :4] = IGNORE_INDEX  # a prompt masked in one row only
    fast, fast_targets = counted_logits(model, batch, keep_positions=True)
    full, full_targets = counted_logits(model, batch, keep_positions=False)
    targets = loss_targets(batch)
    assert torch.equal(fast_targets, full_targets) and len(full_targets) == int((targets != IGNORE_INDEX).sum())
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_theta0s_kept_logits_train_the_point_running_theta0_every_step_trains(models):
    """θ0's logits on the replay are kept between passes (θ0 runs once per batch); the distillation then ends at the
    same point, bit for bit, as one that writes θ0 back and runs it at every step."""
    finetuned, theta0 = models
    points = []
    for cache in (REPAIR_REFERENCE_CACHE_BYTES, 0):
        model = copy.deepcopy(finetuned)
        config = JanusConfig(**FAST, **REPAIR)
        rectifier = Rectifier(model, theta0, random_replay(24), config, progress=False, new_task=new_task_samples())
        repair = Repair(WeightSpace(rectifier.layers, rectifier.outside), rectifier.batches,
                        rectifier.new_task_batches, config, rectifier.world, progress=False,
                        reference_cache_bytes=cache)
        report = repair.run()
        assert (len(repair.reference_cache) > 0) == (cache > 0)
        points.append((report.chosen, model.state_dict()))
    assert points[0][0] == points[1][0]
    for key, value in points[0][1].items():
        assert torch.equal(points[1][1][key], value), key
