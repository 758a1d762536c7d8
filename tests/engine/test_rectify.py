"""End-to-end rectification on tiny causal LMs, checked against explicit per-sample Jacobians."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from testing_utils import VOCAB, build_tiny, fine_tune, random_replay

from hf_janus import JanusConfig, RectificationReport, rectify
from hf_janus.errors import JanusError
from hf_janus.engine.capture import ReplayLosses
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.observer import RunObserver

FAMILIES = ["llama", "gpt2", "mistral", "qwen2"]


def explicit_jacobians(model, reference, samples, names):
    """Per-sample gradients of the token-summed loss w.r.t. each target weight at θ0, one backprop per sample."""
    probe = copy.deepcopy(model)
    probe.load_state_dict({**probe.state_dict(), **{k: v for k, v in reference.items() if k[:-7] in names}})
    modules = dict(probe.named_modules())
    rows = {n: [] for n in names}
    for sample in samples:
        ids = torch.tensor([sample["input_ids"]])
        labels = torch.tensor([sample.get("labels", sample["input_ids"])])
        logits = probe(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
        weights = [modules[n].weight for n in names]
        grads = torch.autograd.grad(loss, weights)
        for n, g in zip(names, grads):
            rows[n].append(rule_for(modules[n]).to_matrix(g).reshape(-1).double())
    return {n: torch.stack(r) for n, r in rows.items()}


def matrices(model, names):
    modules = dict(model.named_modules())
    return {n: rule_for(modules[n]).weight(modules[n]).detach().double() for n in names}


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("ghost_matmul", ["float32", "float64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_step_equals_explicit_projection(family, ghost_matmul):
    """τ=0, no compression: ΔW_rect = ΔW − Jᵀ(JJᵀ)⁺JΔW with J from per-sample backprop, for every layer."""
    model = build_tiny(family)
    reference = fine_tune(model)
    finetuned = copy.deepcopy(model)
    replay = random_replay(6)
    names = list(resolve_target_modules(model))
    config = JanusConfig(tau=0.0, compression_rank=None, replay_batch_size=4, ghost_matmul=ghost_matmul)
    report = rectify(model, reference, replay, config, progress=False)

    jac = explicit_jacobians(finetuned, reference, replay, names)
    ref_w = {n: w for n, w in matrices(build_reference(finetuned, reference), names).items()}
    ft_w, rect_w = matrices(finetuned, names), matrices(model, names)
    for n in names:
        J = jac[n]
        delta = (ft_w[n] - ref_w[n]).reshape(-1)
        expected = delta - torch.linalg.pinv(J) @ (J @ delta)
        got = (rect_w[n] - ref_w[n]).reshape(-1)
        assert torch.allclose(got, expected, atol=2e-6 * delta.abs().max(), rtol=0), n
        assert (J @ got).norm() <= 1e-3 * (J @ delta).norm() + 1e-9, n
    assert report.num_jacobian_evals == 2 and report.converged and len(report.steps) == 1
    assert all(layer.residual is None or layer.residual < 1e-3 for layer in report.layers)


def test_float32_ghost_products_take_the_float64_path_steps(tuned_llama):
    """The default float32 products (float64 sums, refined projections) against every product in float64, on the
    multi-step loop: the same trials, cosines to 1e-6, and the same rectified weights to float32 rounding."""
    model, reference = tuned_llama
    runs = {}
    for matmul in ("float32", "float64"):
        copy_ = copy.deepcopy(model)
        report = rectify(copy_, reference, random_replay(12), JanusConfig(compression_rank=4, replay_batch_size=4,
                                                                          tau=0.99,
                                                                         ghost_matmul=matmul), progress=False)
        runs[matmul] = (report, matrices(copy_, list(resolve_target_modules(copy_))))
    (fast, fast_w), (exact, exact_w) = runs["float32"], runs["float64"]
    assert fast.num_jacobian_evals == exact.num_jacobian_evals and len(exact.steps) >= 2
    for a, b in zip(fast.steps, exact.steps):
        assert [t.alpha for t in a.trials] == [t.alpha for t in b.trials]
        assert [t.mean_cosine for t in a.trials] == pytest.approx([t.mean_cosine for t in b.trials], abs=1e-6)
    for name, w in exact_w.items():
        assert torch.allclose(fast_w[name], w, rtol=0, atol=1e-6 * float(w.abs().max())), name


def build_reference(model, reference):
    ref_model = copy.deepcopy(model)
    ref_model.load_state_dict(reference)
    return ref_model


def test_only_target_layers_change_and_report_is_complete(tuned_llama):
    model, reference = tuned_llama
    before = copy.deepcopy(model.state_dict())
    report = rectify(model, reference, random_replay(8), JanusConfig(compression_rank=4, replay_batch_size=4),
                     progress=False)
    targets = set(resolve_target_modules(model))
    for key, value in model.state_dict().items():
        if key.rsplit(".", 1)[0] in targets:
            continue
        assert torch.equal(value, before[key]), f"{key} is not a target but changed"
    assert any(not torch.equal(model.state_dict()[t + ".weight"], before[t + ".weight"]) for t in targets)
    assert "lm_head" not in targets
    assert report.num_samples == 8 and report.num_tokens > 0
    assert set(report.replay_loss) == {"reference", "finetuned", "rectified"}
    assert {"forward_backward", "compression", "ghost", "total"} <= set(report.timings)
    assert [layer.name for layer in report.layers] == list(resolve_target_modules(model))
    assert report.num_jacobian_evals == 1 + report.num_trials
    assert all(math.isfinite(t.mean_cosine) for s in report.steps for t in s.trials)


def test_report_json_round_trip(tmp_path, tuned_llama):
    model, reference = tuned_llama
    report = rectify(model, reference, random_replay(6), JanusConfig(compression_rank=4), progress=False)
    path = tmp_path / "janus_rectification.json"
    report.save(path)
    loaded = RectificationReport.load(path)
    assert loaded.to_dict() == report.to_dict()
    assert json.loads(path.read_text())["config"]["tau"] == 0.95
    assert "replay loss" in report.summary()


def test_rectification_reduces_replay_loss():
    model, reference, replay = forgetting_setup()
    report = rectify(model, reference, replay, JanusConfig(compression_rank=8), progress=False)
    loss = report.replay_loss
    assert loss["finetuned"] > loss["reference"], "the toy fine-tune should increase the replay loss"
    assert abs(loss["rectified"] - loss["reference"]) < abs(loss["finetuned"] - loss["reference"])


def pattern_batch(n, length, step, low, high, seed):
    """Sequences that count up by ``step`` inside [low, high): a learnable 'task'."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(low, high, (n, 1), generator=gen)
    return low + (start - low + step * torch.arange(length)) % (high - low)


def forgetting_setup():
    """Learn task A, then fine-tune on task B until A's loss rises: a small but real forgetting."""
    model = build_tiny("llama")
    task_a, task_b = pattern_batch(16, 10, 1, 0, 24, 0), pattern_batch(16, 10, 3, 24, 48, 1)
    for data, steps in ((task_a, 60), (task_b, 40)):
        if data is task_b:
            reference = copy.deepcopy(model.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            model(input_ids=data, labels=data).loss.backward()
            opt.step()
            opt.zero_grad()
    model.eval()
    replay = [{"input_ids": row.tolist()} for row in pattern_batch(12, 10, 1, 0, 24, 5)]
    return model, reference, replay


def test_replay_input_forms_agree(tuned_llama):
    """A list, a datasets.Dataset and a DataLoader of the same samples give the same weights."""
    import datasets
    from torch.utils.data import DataLoader

    from hf_janus.replay.prepare import prepare_replay

    model, reference = tuned_llama
    replay = random_replay(6)
    cfg = JanusConfig(tau=0.0, compression_rank=None, replay_batch_size=3)
    results = []
    loader = DataLoader(prepare_replay(replay, 3), batch_size=None)
    for form in (replay, datasets.Dataset.from_list(replay), loader):
        m = copy.deepcopy(model)
        rectify(m, reference, form, cfg, progress=False)
        results.append(m.state_dict())
    for other in results[1:]:
        for key in results[0]:
            torch.testing.assert_close(other[key], results[0][key], rtol=0, atol=1e-6)


def test_padding_invariance(tuned_llama):
    """Batches with right padding, left padding or none at all give the same rectified weights."""
    model, reference = tuned_llama
    replay = random_replay(6)
    cfg = JanusConfig(tau=0.0, compression_rank=None)
    outs = []
    for batches in (one_per_batch(replay), padded(replay, "right"), padded(replay, "left")):
        m = copy.deepcopy(model)
        rectify(m, reference, batches, cfg, progress=False)
        outs.append(m.state_dict())
    for other in outs[1:]:
        for key in outs[0]:
            torch.testing.assert_close(other[key], outs[0][key], rtol=0, atol=2e-6)


def one_per_batch(samples):
    return [{"input_ids": torch.tensor([s["input_ids"]]), "attention_mask": torch.tensor([s["attention_mask"]])}
            for s in samples]


def padded(samples, side):
    width = max(len(s["input_ids"]) for s in samples) + 2
    ids, mask = [], []
    for s in samples:
        pad = width - len(s["input_ids"])
        garbage = [7] * pad  # padding token values must not matter
        if side == "right":
            ids.append(s["input_ids"] + garbage)
            mask.append([1] * len(s["input_ids"]) + [0] * pad)
        else:
            ids.append(garbage + s["input_ids"])
            mask.append([0] * pad + [1] * len(s["input_ids"]))
    return [{"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}]


def test_left_padding_positions_are_consistent():
    """The first real token after left padding is predicted from a pad position and must not count."""
    model = build_tiny("llama")
    reference = fine_tune(model)
    replay = random_replay(4)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = rectify(a, reference, one_per_batch(replay), JanusConfig(tau=0.0, compression_rank=None), progress=False)
    rb = rectify(b, reference, padded(replay, "left"), JanusConfig(tau=0.0, compression_rank=None), progress=False)
    assert ra.num_tokens == rb.num_tokens
    assert ra.replay_loss["reference"] == pytest.approx(rb.replay_loss["reference"], rel=1e-5)


def test_labels_select_counted_tokens(tuned_llama):
    """Without labels every non-pad token counts; labels=input_ids is the same; -100 removes tokens."""
    model, reference = tuned_llama
    replay = random_replay(5)
    with_labels = [{**s, "labels": list(s["input_ids"])} for s in replay]
    half = [{**s, "labels": [-100] * (len(s["input_ids"]) // 2) + s["input_ids"][len(s["input_ids"]) // 2:]}
            for s in replay]
    cfg = JanusConfig(tau=0.0, compression_rank=None)
    reports = []
    for data in (replay, with_labels, half):
        reports.append(rectify(copy.deepcopy(model), reference, data, cfg, progress=False))
    assert reports[0].num_tokens == reports[1].num_tokens > reports[2].num_tokens
    assert reports[0].replay_loss["reference"] == pytest.approx(reports[1].replay_loss["reference"], rel=1e-6)


def test_disk_cache_matches_memory(tmp_path, tuned_llama):
    model, reference = tuned_llama
    replay = random_replay(6)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    ra = rectify(a, reference, replay, JanusConfig(compression_rank=4, replay_batch_size=2), progress=False)
    rb = rectify(b, reference, replay, JanusConfig(compression_rank=4, replay_batch_size=2,
                                                   cache=str(tmp_path / "cache")),
                 progress=False)
    assert ra.alphas == rb.alphas
    for key, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[key], value, rtol=0, atol=1e-6)
    assert list((tmp_path / "cache").iterdir()) == [], "cache files must be cleaned up"


def test_bf16_model():
    model = build_tiny("llama")
    reference = fine_tune(model)
    model = model.to(torch.bfloat16)
    finetuned = copy.deepcopy(model.state_dict())
    report = rectify(model, reference, random_replay(6), JanusConfig(compression_rank=4), progress=False)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert all(math.isfinite(v) for v in report.replay_loss.values())
    changed = [k for k in finetuned if not torch.equal(finetuned[k], model.state_dict()[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)


def test_randomized_compression_matches_exact_when_samples_fit(tuned_llama):
    """Replay samples of <= 12 tokens: the randomized sketch (r + 16 columns) sees each gradient's whole range,
    so the GPU path's compression must give the exact path's rectification, on any device."""
    model, reference = tuned_llama
    replay = random_replay(8)
    exact, randomized = copy.deepcopy(model), copy.deepcopy(model)
    re = rectify(exact, reference, replay, JanusConfig(compression_rank=3, compression="exact", replay_batch_size=4),
                 progress=False)
    rr = rectify(randomized, reference, replay, JanusConfig(compression_rank=3, compression="randomized",
                                                            replay_batch_size=4),
                 progress=False)
    assert re.alphas == rr.alphas
    for key, value in exact.state_dict().items():
        torch.testing.assert_close(randomized.state_dict()[key], value, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="JanusConfig.compression='svd' is invalid"):
        JanusConfig(compression="svd")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_of_low_precision_weights_is_reported(caplog, dtype):
    """An update of 5% of the weights' spread: in bf16 the projection's correction is below the weights'
    resolution, the written weights keep much of J0 ΔW, and the log says so and what to do; float32 holds it."""
    model = build_tiny("llama").to(dtype)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in resolve_target_modules(model):
            w = model.get_submodule(name).weight
            w.add_((0.05 * w.float().std() * torch.randn(w.shape, generator=gen)).to(dtype))
    with caplog.at_level("WARNING", logger="hf_janus.engine.rectifier"):
        report = rectify(model, reference, random_replay(8), JanusConfig(tau=0.0, compression_rank=None),
                         progress=False)
    warned = [r.getMessage() for r in caplog.records if "rounding of the written weights" in r.getMessage()]
    worst = max(layer.residual for layer in report.layers if layer.residual is not None)
    if dtype == torch.bfloat16:
        assert worst > 0.05 and len(warned) == 1 and "model.float()" in warned[0], (worst, warned)
    else:
        assert worst < 1e-3 and not warned


def test_target_modules_list_and_regex(tuned_llama):
    model, reference = tuned_llama
    rep = rectify(copy.deepcopy(model), reference, random_replay(4), JanusConfig(target_modules=["q_proj", "v_proj"]),
                  progress=False)
    assert {layer.name.split(".")[-1] for layer in rep.layers} == {"q_proj", "v_proj"}
    rep = rectify(copy.deepcopy(model), reference, random_replay(4),
                  JanusConfig(target_modules=r".*layers\.1\.mlp\..*"), progress=False)
    assert len(rep.layers) == 3
    rep = rectify(copy.deepcopy(model), reference, random_replay(4),
                  JanusConfig(exclude_modules=["down_proj"]), progress=False)
    assert not any(layer.name.endswith("down_proj") for layer in rep.layers)


# ---- the multi-step loop's accept / shrink logic --------------------------------------------------------

@dataclasses.dataclass
class ScriptedLoss(ReplayLosses):
    """A capture whose replay loss is the script's, not the one its per-sample losses give."""

    scripted: float = math.nan

    @property
    def loss(self) -> float:
        return self.scripted


class Scripted(RunObserver):
    """The run's hooks: the orientation comparison replaced by a script of mean cosines (``queue``, one per trial),
    and the replay loss of the captures tagged in ``losses`` (what the final-step guard compares) by a script."""

    def __init__(self, cosines, losses=None):
        self.queue, self.losses = list(cosines), dict(losses or {})

    def compare(self, loop, current_tag, trial_tag):
        for layer in loop.layers:
            layer.trial_eig = layer.eig
        c = self.queue.pop(0)
        return c, {layer.name: c for layer in loop.layers}

    def captured(self, tag, capture):
        if tag not in self.losses:
            return capture
        return ScriptedLoss(capture.tag, capture.sample_loss, capture.sample_tokens, scripted=self.losses[tag])


def scripted_rectify(script: Scripted, model, reference, replay, config) -> RectificationReport:
    """``rectify(model, reference, replay, config, progress=False)`` through the script's hooks."""
    return Rectifier(model, reference, replay, config, progress=False, observer=script).run().report


def test_loop_shrinks_until_accepted_then_takes_full_step(tuned_llama):
    model, reference = tuned_llama
    script = Scripted([0.5, 0.9, 0.96, 0.99])
    queue = script.queue
    report = scripted_rectify(script, model, reference, random_replay(4),
                              JanusConfig(tau=0.95, beta=0.5, compression_rank=4, step_control="paper"))
    assert report.alphas == [0.25, 1.0]
    assert [t.taken for t in report.steps[0].trials] == [False, False, True]
    assert [t.alpha for t in report.steps[0].trials] == [1.0, 0.5, 0.25]
    assert report.num_jacobian_evals == 5 and report.converged and not queue


def test_loop_geometry_matches_accepted_steps(tuned_llama):
    """After steps α1, α2=1 the weights are θ0 + α1 P1 + P2: the final full step ends at the projection."""
    model, reference = tuned_llama
    scripted_rectify(Scripted([0.0, 1.0, 1.0]), model, reference, random_replay(4),
                     JanusConfig(tau=0.5, beta=0.7, compression_rank=4, step_control="paper"))
    ref = reference["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, ref)


def test_tau_zero_is_single_step(tuned_llama):
    model, reference = tuned_llama
    report = scripted_rectify(Scripted([0.0]), model, reference, random_replay(4), JanusConfig(tau=0.0,
                                                                                               compression_rank=4))
    assert report.alphas == [1.0] and report.num_jacobian_evals == 2 and report.converged


def test_current_jacobian_kept_across_trials_changes_nothing(tuned_llama):
    """J_t's materialized rows, kept for the trials of a step, give the same run as rebuilding them per trial."""
    from hf_janus.engine.workspace import Workspace

    model, reference = tuned_llama
    built = []

    class CountingWorkspace(Workspace):
        def take(self, shape, dtype, device):  # one buffer per build of a layer's per-sample gradients
            built.append(1)
            return super().take(shape, dtype, device)

    class Materialized(RunObserver):
        def jacobian_path(self, name, tag):
            return "materialized"

        def make_workspace(self):
            return CountingWorkspace()
    cfg = JanusConfig(tau=0.9999, beta=0.5, min_alpha=0.1, max_steps=2, compression_rank=4, step_control="paper",
                      final_step="paper")  # every trial stays in report.steps
    runs = []
    for keep in (True, False):
        built.clear()
        m = copy.deepcopy(model)
        # every layer on the materialized path; without room for J_t's rows (materialize_max_bytes=0) none is kept
        rectifier = Rectifier(m, reference, random_replay(4), cfg if keep else dataclasses.replace(
            cfg, materialize_max_bytes=0), progress=False, observer=Materialized())
        report = rectifier.run().report
        assert all(layer.current_jac is None for layer in rectifier.layers)  # released when the run ends
        assert {layer.path for layer in report.layers} == {"materialized"}
        runs.append((m.state_dict(), [t.mean_cosine for s in report.steps for t in s.trials], len(built)))
    (kept, cos_kept, n_kept), (rebuilt, cos_rebuilt, n_rebuilt) = runs
    assert len(cos_kept) >= 3 and cos_kept == cos_rebuilt
    for key in kept:
        assert torch.equal(kept[key], rebuilt[key])
    layers = len(rectifier.layers)
    assert n_rebuilt - n_kept == layers * len(cos_kept)  # J_t is built once per step, not again for each trial


def test_min_alpha_forces_step_and_says_so(tuned_llama):
    model, reference = tuned_llama
    report = scripted_rectify(Scripted([0.1, 0.1, 0.99]), model, reference, random_replay(4),
                              JanusConfig(tau=0.95, beta=0.5, min_alpha=0.3, compression_rank=4, step_control="paper"))
    # 1 -> 0.5 tried; 0.25 would be below min_alpha, so α=0.5 is taken although c̄ < τ.
    assert report.alphas == [0.5, 1.0]
    assert report.steps[0].forced and not report.steps[1].forced and report.converged


def test_max_steps_takes_final_unchecked_step(tuned_llama):
    model, reference = tuned_llama
    report = scripted_rectify(Scripted([0.1, 0.99, 0.1]), model, reference, random_replay(4),
                              JanusConfig(tau=0.95, beta=0.5, max_steps=2, compression_rank=4, step_control="paper",
                                          final_step="paper"))
    assert report.alphas == [0.5, 1.0]
    assert report.steps[-1].forced and not report.converged and "max_steps" in report.stop_reason
    assert report.discarded_final_step is None


@pytest.mark.parametrize("worse", [True, False])
def test_guarded_final_step_never_undoes_the_work(tuned_llama, worse):
    """final_step='guarded' (the default): the unchecked step at max_steps is kept only if the replay loss does
    not rise above the last accepted point's; otherwise that point is returned and the report says so."""
    model, reference = tuned_llama
    finetuned = copy.deepcopy(model.state_dict())
    cfg = JanusConfig(tau=0.95, beta=0.5, max_steps=2, compression_rank=4, step_control="paper")
    losses = {"s0t1": 0.5, "s1t0": 0.7 if worse else 0.4}
    report = scripted_rectify(Scripted([0.1, 0.99, 0.1], losses), model, reference, random_replay(4), cfg)
    if not worse:
        assert report.alphas == [0.5, 1.0] and report.steps[-1].forced and report.discarded_final_step is None
        return
    assert report.alphas == [0.5] and not report.converged
    assert report.discarded_final_step == {"alpha": 1.0, "mean_cosine": 0.1, "replay_loss": 0.7,
                                           "kept_replay_loss": 0.5}
    assert "which is returned" in report.stop_reason and report.num_jacobian_evals == 4
    assert [t.taken for t in report.steps[0].trials] == [False, True]
    # the weights are those of the last accepted point: what a budget ending the loop there leaves
    guarded = copy.deepcopy(model.state_dict())
    model.load_state_dict(finetuned)
    stopped = scripted_rectify(Scripted([0.1, 0.99], losses), model, reference, random_replay(4),
                               dataclasses.replace(cfg, max_evaluations=3))
    assert stopped.alphas == [0.5] and stopped.stopped_early
    assert stopped.replay_loss["rectified"] == report.replay_loss["rectified"]
    for key, value in model.state_dict().items():
        assert torch.equal(value, guarded[key]), key


# ---- replay batching, reference forms (refusals of bad input: test_hostile_inputs.py) -----------------

def test_replay_samples_are_grouped_by_length():
    from hf_janus.replay.prepare import prepare_replay

    lengths = [9, 2, 7, 2, 5, 3, 8]
    replay = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    batches = prepare_replay(replay, 3)
    widths = [int(b["input_ids"].shape[1]) for b in batches]
    counted = [int(n) for b in batches for n in b["attention_mask"].sum(dim=1)]
    assert counted == sorted(lengths)  # stable sort: every sample once, shortest first
    assert widths == [max(counted[i:i + 3]) for i in range(0, len(counted), 3)]


def test_reference_model_equals_state_dict(tuned_llama):
    model, reference = tuned_llama
    ref_model = build_reference(model, reference)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    rectify(a, reference, random_replay(4), JanusConfig(tau=0.0), progress=False)
    rectify(b, ref_model, random_replay(4), JanusConfig(tau=0.0), progress=False)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])


# ---- constraints: the Jacobian of the loss at softmax temperature T, or of the target logits -----------------

def constraint_jacobians(model, weights, replay, constrained):
    """Explicit per-sample gradients (torch.func) of ``constrained(logits, ids)`` (one sample), w.r.t. each layer
    weight in ``weights``, at those weights: ``{layer: (m, d_out, d_in)}``."""
    from torch.func import functional_call, grad

    params = {k: v.detach() for k, v in model.named_parameters()}

    def value(target_params, ids):
        return constrained(functional_call(model, {**params, **target_params}, kwargs={"input_ids": ids}).logits, ids)

    rows = {name: [] for name in weights}
    for sample in replay:
        g = grad(value)({f"{n}.weight": w for n, w in weights.items()}, torch.tensor([sample["input_ids"]]))
        for name in weights:
            rows[name].append(g[f"{name}.weight"])
    return {name: torch.stack(r) for name, r in rows.items()}


def tempered_loss(temperature):
    return lambda logits, ids: F.cross_entropy(logits[0, :-1] / temperature, ids[0, 1:], reduction="sum")


def target_logits(logits, ids):
    return logits[0, :-1].gather(-1, ids[0, 1:, None]).sum()


def projected_logits(k):
    """The k functions of constraint='logit_projections' (the engine's directions, seed 0)."""
    from hf_janus.engine.constraints import logit_projections

    directions = logit_projections(VOCAB, k, 0, torch.device("cpu"), torch.float32).double()
    return [lambda logits, ids, j=j: (logits[0, :-1] @ directions[:, j]).sum() for j in range(k)]


@pytest.mark.parametrize("constraints, fields", [
    ([tempered_loss(4.0)], {"constraint_options": {"temperature": 4.0}}),
    ([target_logits], {"constraint": "target_logit"}),
    (projected_logits(3), {"constraint": "logit_projections", "constraint_options": {"projections": 3}}),
], ids=["loss at T=4", "target logit", "3 logit projections"])
def test_constraint_keeps_its_jacobian(tuned_llama, constraints, fields):
    """With the loss's temperature T (constraint='target_logit', 'logit_projections') the rectified update lies in the
    null space of the per-sample Jacobians of the loss at temperature T (of the summed target logits, of each sample's
    k projected logit sums), explicit with torch.func; the paper's constraint (the loss at T=1) does not give that."""
    model, reference = tuned_llama
    replay = random_replay(5)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    theta0 = {n: reference[f"{n}.weight"].double() for n in names}
    probe = copy.deepcopy(model).double().eval()
    parts = [constraint_jacobians(probe, theta0, replay, c) for c in constraints]
    jac = {n: torch.cat([p[n].reshape(len(replay), -1) for p in parts]) for n in names}
    residuals = {}
    for label, config in (("chosen", fields), ("paper", {})):
        rectified = copy.deepcopy(model)
        report = rectify(rectified, reference, replay, JanusConfig(tau=0.0, compression_rank=None, **config),
                         progress=False)
        assert report.converged
        worst = 0.0
        for n in names:
            delta = rectified.get_submodule(n).weight.detach().double() - theta0[n]
            j = jac[n]
            worst = max(worst, float((j @ delta.reshape(-1)).norm() / (j.norm() * delta.norm())))
        residuals[label] = worst
    assert residuals["chosen"] < 1e-6, residuals
    assert residuals["paper"] > 100 * residuals["chosen"], residuals


def test_damped_projection_of_the_loss_jacobian(tuned_llama):
    """damping=δ: single-step JANUS writes θ0 + ΔW − Jᵀ(JJᵀ + λI)⁻¹JΔW per layer, λ = δ·max eig(JJᵀ), with J the
    per-sample loss gradients at θ0 from torch.func; it keeps more of the update than the exact projection."""
    model, reference = tuned_llama
    replay = random_replay(5)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    theta0 = {n: reference[f"{n}.weight"].double() for n in names}
    jac = constraint_jacobians(copy.deepcopy(model).double().eval(), theta0, replay, tempered_loss(1.0))
    rectified = {}
    for damping in (0.0, 0.05):
        out = copy.deepcopy(model)
        report = rectify(out, reference, replay, JanusConfig(tau=0.0, compression_rank=None, damping=damping),
                         progress=False)
        assert report.converged and report.config["damping"] == damping
        rectified[damping] = {n: out.get_submodule(n).weight.detach().double() - theta0[n] for n in names}
    for n in names:
        j = jac[n].reshape(len(replay), -1)
        full = model.get_submodule(n).weight.detach().double() - theta0[n]
        gram = j @ j.T
        lam = 0.05 * float(torch.linalg.eigvalsh(gram).max())
        want = full.reshape(-1) - j.T @ torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype),
                                                           j @ full.reshape(-1))
        got = rectified[0.05][n].reshape(-1)
        assert float((got - want).norm()) <= 1e-5 * float(full.norm()), n
        # the row-space part it keeps: more first-order change of the replay loss than the exact projection
        exact = rectified[0.0][n].reshape(-1)
        assert float((j @ got).norm()) > 10 * float((j @ exact).norm()), n
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="damping"):
            JanusConfig(damping=bad)


def test_a_temperature_needs_the_loss_constraint():
    with pytest.raises(JanusError, match="'target_logit' has no option 'temperature'"):
        JanusConfig(constraint="target_logit", constraint_options={"temperature": 2.0})
    with pytest.raises(ValueError, match=r"constraint_options\['temperature'\]"):
        JanusConfig(constraint_options={"temperature": 0})
    with pytest.raises(ValueError, match="constraint"):
        JanusConfig(constraint="logits")


def test_weights_that_require_grad_build_no_graph(tuned_llama):
    """θ0 and θ̂ handed over as tensors that require grad (a state dict of parameters, an adapter's product): the
    rectification builds no autograd graph through its projections (which would hold every step's tensors), warns
    nothing, and gives the same weights as with detached inputs."""
    import warnings

    model, reference = tuned_llama
    finetuned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain = copy.deepcopy(model)
    rectify(plain, reference, random_replay(4), JanusConfig(compression_rank=4, max_steps=3), progress=False,
            finetuned=finetuned)
    tracked_reference = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in reference.items()}
    tracked_finetuned = {k: v.clone().requires_grad_(True) for k, v in finetuned.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        rectify(model, tracked_reference, random_replay(4), JanusConfig(compression_rank=4, max_steps=3),
                progress=False,
                finetuned=tracked_finetuned)
    for name, value in model.state_dict().items():
        assert not value.requires_grad and torch.equal(value, plain.state_dict()[name]), name
