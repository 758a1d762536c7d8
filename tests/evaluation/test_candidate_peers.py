"""The post-hoc peers as frontier candidates, each against an independent computation on a tiny model: replay
fine-tuning (a plain PyTorch loop, from θ̂ and from a JANUS result), the input-covariance null space and one-sided
RegMean (Grams and projections in numpy), the diagonal Fisher (its gradients derived by hand), LiNeS (the scale of
each block written out) and DG-Hard (Gavish & Donoho's threshold in numpy); and, for LoRA, WiSE-FT against PEFT's
``rescale_adapter_scale``."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_janus import JanusConfig
from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidate_weights import WeightBuilder
from hf_janus.evaluation.candidates import (BuildContext, DgHard, Fisher, InputNull, Janus, JanusRepair, Lines,
                                            RegMean, ReplaySft, Wise)
from hf_janus.evaluation.candidates.dg_hard import hard_threshold, omega
from testing_utils import build_tiny, fine_tune

VOCAB, WIDTH, HIDDEN = 7, 5, 4


class TinyLM(nn.Module):
    """embedding → tanh(Linear) → Linear head: small enough to write every input and gradient out by hand."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask=None):
        return (self.head(torch.tanh(self.hidden(self.embed(input_ids)))),)


# samples of different lengths: the batches carry right padding, which must not count
SAMPLES = [[1, 2, 3, 4, 5], [2, 6, 1], [0, 3, 3, 5], [4, 1, 6, 2, 0, 5]]
REPLAY = [{"input_ids": ids} for ids in SAMPLES]


def tiny_pair(seed: int = 0) -> tuple[TinyLM, dict[str, torch.Tensor]]:
    """θ̂ (the model) and θ0 (a state dict): every parameter moved by a random update."""
    model = TinyLM(seed)
    theta0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model, theta0


def builder_for(model: nn.Module, theta0: dict[str, torch.Tensor], replay=REPLAY, **kwargs) -> WeightBuilder:
    params = dict(model.named_parameters())
    changed = [k for k, p in params.items() if not torch.equal(p.detach(), theta0[k])]
    return WeightBuilder(model, {k: theta0[k].clone() for k in changed},
                         {k: params[k].detach().clone() for k in changed}, None, None, replay, **kwargs)


def context(batch_size: int = 2, rectify_fn=None) -> BuildContext:
    return BuildContext(config=JanusConfig(replay_batch_size=batch_size), rectify_fn=rectify_fn)


def built(candidate, builder: WeightBuilder, ctx: BuildContext = None):
    cost = candidate.prepare(builder, ctx or context())
    return candidate.weights(builder), cost


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


# ---- the replay inputs of each linear layer at θ0, written out ----------------------------------------------------
def layer_inputs(theta0: dict[str, torch.Tensor], tokens: str) -> dict[str, np.ndarray]:
    """Rows x of every token's input to ``hidden`` (its embedding) and to ``head`` (tanh of hidden) at θ0."""
    emb, w, b = np64(theta0["embed.weight"]), np64(theta0["hidden.weight"]), np64(theta0["hidden.bias"])
    rows_hidden, rows_head = [], []
    for ids in SAMPLES:
        kept = ids if tokens == "all" else ids[:-1]  # "loss": positions whose next token is a target
        for t in kept:
            e = emb[t]
            rows_hidden.append(e)
            rows_head.append(np.tanh(w @ e + b))
    return {"hidden.weight": np.array(rows_hidden), "head.weight": np.array(rows_head)}


def energy_rank(values: np.ndarray, energy: float) -> int:
    share = np.cumsum(values) / values.sum()
    return int(np.argmax(share >= energy)) + 1


@pytest.mark.parametrize("tokens", ["all", "loss"])
@pytest.mark.parametrize("energy", [0.5, 0.9, 0.999])
def test_input_null_space_projection_matches_numpy(tokens, energy):
    model, theta0 = tiny_pair()
    builder = builder_for(model, theta0)
    weights, cost = built(InputNull(energy, tokens=tokens), builder)
    assert cost.forward_passes == 1 and cost.backward_passes == 0 and cost.jacobian_evaluations == 0
    assert not cost.reused
    for key, x in layer_inputs(theta0, tokens).items():
        gram = x.T @ x
        values, vectors = np.linalg.eigh(gram)
        values, vectors = values[::-1], vectors[:, ::-1]
        top = vectors[:, :energy_rank(values, energy)]
        delta = np64(builder.finetuned[key]) - np64(theta0[key])
        want = np64(theta0[key]) + delta @ (np.eye(len(gram)) - top @ top.T)
        np.testing.assert_allclose(np64(weights[key]), want, atol=1e-5)
    # parameters that are not linear-layer weights keep θ̂
    for key in ("embed.weight", "hidden.bias"):
        assert torch.equal(weights[key], builder.finetuned[key].float())
    # θ̂ again in the model, and the Grams are shared: a second energy costs no pass, and says its cost is elsewhere
    assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())
    again = InputNull(0.5, tokens=tokens).prepare(builder, context())
    assert again.forward_passes == 0 and again.seconds == 0 and again.reused


@pytest.mark.parametrize("lam", [1.0, 0.01])
def test_one_sided_regmean_matches_its_closed_form(lam):
    model, theta0 = tiny_pair(seed=1)
    builder = builder_for(model, theta0)
    weights, _ = built(RegMean(lam), builder)
    for key, x in layer_inputs(theta0, "all").items():
        gram = x.T @ x
        reg = lam * np.linalg.eigvalsh(gram).max()
        delta = np64(builder.finetuned[key]) - np64(theta0[key])
        # the closed form, solved directly: W0 + ΔW (I − G(G + λI)⁻¹)
        want = np64(theta0[key]) + delta @ (np.eye(len(gram)) - gram @ np.linalg.inv(gram + reg * np.eye(len(gram))))
        np.testing.assert_allclose(np64(weights[key]), want, atol=1e-5)


def test_input_null_space_on_gpt2_leaves_the_replay_inputs_unchanged():
    """Orientation on GPT-2's Conv1D (y = x W, W stored (d_in, d_out)): with fewer replay tokens than input
    dimensions and all of their energy removed, the projected update maps every captured input to 0."""
    tuned = build_tiny("gpt2")
    reference = fine_tune(tuned)
    replay = [{"input_ids": [3, 7, 1, 9]}, {"input_ids": [5, 2, 8]}]  # 7 tokens < 16 input dimensions
    builder = builder_for(tuned, {k: v for k, v in reference.items()}, replay=replay)
    weights, _ = built(InputNull(1 - 1e-12), builder)

    captured: dict[str, list[torch.Tensor]] = {}
    base = build_tiny("gpt2")
    base.load_state_dict(reference)
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: captured.setdefault(n, []).append(
        args[0].reshape(-1, args[0].shape[-1]))) for n, m in base.named_modules() if type(m).__name__ == "Conv1D"]
    with torch.no_grad():
        for sample in replay:
            base(torch.tensor([sample["input_ids"]]))
    for h in hooks:
        h.remove()
    checked = 0
    for name, xs in captured.items():
        key = name + ".weight"
        if key not in builder.theta0:
            continue
        x = torch.cat(xs).double()
        new_delta = weights[key].double() - builder.theta0[key].double()
        old_delta = builder.finetuned[key].double() - builder.theta0[key].double()
        assert (x @ new_delta).abs().max() < 1e-5 * (x @ old_delta).abs().max()
        assert new_delta.abs().max() > 1e-3 * old_delta.abs().max()  # not simply θ0
        checked += 1
    assert checked >= 4


# ---- diagonal Fisher, with the gradients derived by hand ----------------------------------------------------------
def fisher_by_hand(theta0: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    emb, w, b, head = (np64(theta0[k]) for k in ("embed.weight", "hidden.weight", "hidden.bias", "head.weight"))
    total = {"embed.weight": np.zeros_like(emb), "hidden.weight": np.zeros_like(w), "hidden.bias": np.zeros_like(b),
             "head.weight": np.zeros_like(head)}
    for ids in SAMPLES:
        grad = {k: np.zeros_like(v) for k, v in total.items()}
        for t, target in zip(ids[:-1], ids[1:]):
            e = emb[t]
            h = np.tanh(w @ e + b)
            logits = head @ h
            p = np.exp(logits - logits.max())
            p /= p.sum()
            dlogits = p - np.eye(VOCAB)[target]  # ∂CE/∂logits
            grad["head.weight"] += np.outer(dlogits, h)
            dpre = (head.T @ dlogits) * (1 - h ** 2)
            grad["hidden.weight"] += np.outer(dpre, e)
            grad["hidden.bias"] += dpre
            grad["embed.weight"][t] += w.T @ dpre
        for k in total:
            total[k] += grad[k] ** 2
    return total


@pytest.mark.parametrize("strength", [0.1, 10.0])
def test_fisher_interpolation_matches_hand_derived_gradients(strength):
    model, theta0 = tiny_pair(seed=2)
    builder = builder_for(model, theta0)
    weights, cost = built(Fisher(strength), builder)
    assert (cost.forward_passes, cost.backward_passes) == (1.0, 1.0) and not cost.reused
    assert Fisher(2 * strength).prepare(builder, context()).reused  # the same Fisher, charged to the first point
    for key, fisher in fisher_by_hand(theta0).items():
        normalized = fisher / fisher.mean()
        back = strength * normalized / (strength * normalized + 1)
        t1 = np64(builder.finetuned[key])
        want = t1 - back * (t1 - np64(theta0[key]))
        np.testing.assert_allclose(np64(weights[key]), want, atol=1e-5, rtol=1e-4)
    # token 5 only ever ends a sample, so no loss reads its embedding: no Fisher there, and the row keeps θ̂
    assert all(5 not in ids[:-1] for ids in SAMPLES)
    assert torch.equal(weights["embed.weight"][5], builder.finetuned["embed.weight"][5])
    assert not torch.equal(weights["embed.weight"][1], builder.finetuned["embed.weight"][1])
    assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())


# ---- replay fine-tuning, against a plain PyTorch loop ---------------------------------------------------------------
EQUAL = [{"input_ids": ids} for ids in ([1, 2, 3, 4], [2, 6, 1, 0], [0, 3, 3, 5])]  # one batch, no padding


# the new task's samples, one to a batch, the longer first (they are taken in the order given, not grouped by
# length); the prompt's tokens carry no loss
NEW_TASK = [{"input_ids": [3, 1, 4, 2, 6], "labels": [-100, -100, 4, 2, 6]},
            {"input_ids": [6, 5, 0, 1], "labels": [-100, -100, 0, 1]}]


def train_by_hand(model: TinyLM, theta0: dict[str, torch.Tensor], passes: int, loss: str, optimizer: str,
                  lr: float, new_task_weight: float = 0.0) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    ref = TinyLM()
    ref.load_state_dict(theta0)
    ids = torch.tensor([s["input_ids"] for s in EQUAL])
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    for step in range(passes):
        logits = model(ids)[0][:, :-1]
        if loss == "ce":
            value = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                p0 = torch.softmax(ref(ids)[0][:, :-1], -1).reshape(-1, VOCAB)
            value = (p0 * (p0.log() - torch.log_softmax(logits, -1).reshape(-1, VOCAB))).sum(-1).mean()
        if new_task_weight:  # one new-task sample a step, in turn: its answer tokens' cross-entropy
            sample = NEW_TASK[step % len(NEW_TASK)]
            new_logits = model(torch.tensor([sample["input_ids"]]))[0][0, 1:-1]
            value = value + new_task_weight * F.cross_entropy(new_logits, torch.tensor(sample["labels"][2:]))
        opt.zero_grad()
        value.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("loss,optimizer,lr", [("ce", "adam", 1e-2), ("kl", "adam", 1e-2), ("ce", "sgd", 0.5)])
def test_replay_fine_tuning_matches_a_plain_training_loop(loss, optimizer, lr):
    model, theta0 = tiny_pair(seed=3)
    builder = builder_for(model, theta0, replay=EQUAL)
    candidate = ReplaySft(passes=3, loss=loss, optimizer=optimizer, lr=lr)
    weights, cost = built(candidate, builder, context(batch_size=len(EQUAL)))
    want = train_by_hand(model, theta0, 3, loss, optimizer, lr)
    for k, w in want.items():
        assert torch.allclose(weights[k], w, atol=1e-6), k
        assert not torch.allclose(weights[k], builder.finetuned[k], atol=1e-4), k  # it did train
    assert (cost.forward_passes, cost.backward_passes) == ((6.0 if loss == "kl" else 3.0), 3.0)
    assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())
    again = builder.weights(candidate)  # kept: the same weights without training again
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_replay_fine_tuning_budget_counts_janus_evaluations():
    model, theta0 = tiny_pair(seed=3)
    builder = builder_for(model, theta0, replay=EQUAL)
    runs = []

    def fake_janus(model, reference, replay, config, progress, finetuned):
        runs.append(config.tau)  # leaves θ̂ as it is: only the evaluation count matters here
        return RectificationReport(config={}, num_jacobian_evals=2)

    ctx = context(batch_size=len(EQUAL), rectify_fn=fake_janus)
    weights, cost = built(ReplaySft(budget=1.5, janus_tau=0.9, lr=1e-2), builder, ctx)
    assert runs == [0.9] and cost.jacobian_evaluations == 2 and cost.forward_passes == 3.0
    want = train_by_hand(model, theta0, 3, "ce", "adam", 1e-2)
    assert all(torch.allclose(weights[k], w, atol=1e-6) for k, w in want.items())
    # a second budget reuses the JANUS run
    assert built(ReplaySft(budget=0.5, janus_tau=0.9, lr=1e-2), builder, ctx)[1].jacobian_evaluations == 0
    assert runs == [0.9]


def test_janus_repair_is_one_rectification_with_the_repair_and_a_janus_point_has_none():
    """The candidate is a view of the engine's stage: one call of the rectifier with its settings as the
    ``JanusConfig``'s repair fields and the frontier's new-task samples; a plain JANUS point of the same frontier runs
    with the repair off even where the run's config has it on. What the rectifier leaves in the model is the point."""
    model, theta0 = tiny_pair(seed=3)
    new_task = [{"input_ids": [3, 1, 4, 2]} for _ in range(8)]
    builder = builder_for(model, theta0, replay=EQUAL * 3, new_task=new_task)
    calls = []

    def halving_rectifier(model, reference, replay, config, progress, finetuned, **repair):
        calls.append((config, repair))
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_((reference[k] + finetuned[k]) / 2)
        return RectificationReport(config={}, num_jacobian_evals=3)

    ctx = BuildContext(config=JanusConfig(replay_batch_size=3, distill_replay_batch_size=3, distill_steps=7),
                       rectify_fn=halving_rectifier)
    candidate = JanusRepair(tau=0.9, steps=6, keep_gain=0.8, lr=1e-3, new_task_weight=0.5, new_task_batch_size=3)
    candidate.check(builder)
    weights, cost = built(candidate, builder, ctx)
    config, repair = calls[-1]
    assert (config.tau, config.distill_steps, config.keep_gain, config.distill_lr, config.new_task_weight,
            config.new_task_batch_size) == (0.9, 6, 0.8, 1e-3, 0.5, 3)
    assert repair == {"new_task": new_task}
    for k, w in weights.items():
        assert torch.allclose(w, (theta0[k].float() + builder.finetuned[k].float()) / 2, atol=1e-6), k
    # JANUS's evaluations, and 6 steps of one 3-sample replay batch (distill_replay_batch_size) over 9 samples: 2
    # replay passes forward and backward, the forward twice (θ0's distributions)
    assert (cost.jacobian_evaluations, cost.forward_passes, cost.backward_passes) == (3, 4.0, 2.0)
    assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())
    assert candidate.prepare(builder, ctx).reused and len(calls) == 1
    built(Janus(0.9), builder, ctx)
    assert calls[-1][0].distill_steps == 0 and calls[-1][1] == {}
    assert "distill_steps=6" in candidate.describe() and candidate.label.startswith("JANUS τ=0.9 → repair 6 steps")
    with pytest.raises(JanusError, match="janus-repair fits the new task's samples .* none were given"):
        candidate.check(builder_for(model, theta0, replay=EQUAL * 3))
    with pytest.raises(JanusError, match="give at least 8 new-task samples"):
        candidate.check(builder_for(model, theta0, replay=EQUAL * 3, new_task=new_task[:7]))


def test_replay_training_that_fits_the_new_task_too_matches_a_plain_training_loop():
    """With ``new_task_weight``, each replay step also fits the next new-task batch (in turn) at that weight of its
    cross-entropy; without the new task's samples the candidate is refused before any training."""
    model, theta0 = tiny_pair(seed=3)
    builder = builder_for(model, theta0, replay=EQUAL, new_task=NEW_TASK)
    candidate = ReplaySft(passes=3, loss="kl", lr=1e-2, new_task_weight=0.5, new_task_batch_size=1)
    candidate.check(builder)
    weights, cost = built(candidate, builder, context(batch_size=len(EQUAL)))
    want = train_by_hand(model, theta0, 3, "kl", "adam", 1e-2, new_task_weight=0.5)
    replay_only = train_by_hand(model, theta0, 3, "kl", "adam", 1e-2)
    for k, w in want.items():
        assert torch.allclose(weights[k], w, atol=1e-6), k
        assert not torch.allclose(w, replay_only[k], atol=1e-4), k  # the new task's samples moved it
    assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())
    without = builder_for(model, theta0, replay=EQUAL)
    with pytest.raises(JanusError, match="replay-sft: new_task_weight fits the new task's samples too, but none were "
                                         "given; pass new_task_samples= to frontier"):
        candidate.check(without)


def test_replay_training_steps_are_the_nearest_whole_passes():
    """``steps`` counts optimizer steps, one per replay batch, and trains the nearest whole number of passes (at
    least one): the same training as ``passes`` gives, so that a recipe measured at one replay size keeps its
    training at another."""
    model, theta0 = tiny_pair(seed=3)

    def make(**length):
        return ReplaySft(loss="kl", lr=1e-2, batch_size=1, **length)  # EQUAL in batches of one: 3 steps a pass

    ctx = context()
    for steps, passes in ((1, 1), (4, 1), (5, 2), (7, 2), (8, 3)):
        builder = builder_for(model, theta0, replay=EQUAL)
        weights, cost = built(make(steps=steps), builder, ctx)
        want, _ = built(make(passes=passes), builder_for(model, theta0, replay=EQUAL), ctx)
        assert cost.backward_passes == passes, steps
        assert all(torch.equal(weights[k], w) for k, w in want.items()), steps
    assert make(steps=8).label.startswith("replay SFT 8 steps")
    assert "about 8 optimizer steps (the nearest whole number of passes over the replay)" in make(steps=8).describe()


def test_new_task_samples_without_a_labelled_token_are_refused_before_any_work():
    """The check names the data the user gave (the new task's samples, not the replay) and which of them: a sample
    with no label is refused even when the others of its batch have some, since fitting it would fit nothing."""
    model, theta0 = tiny_pair(seed=3)
    labelled = {"input_ids": [3, 1, 4], "labels": [-100, 1, 4]}
    unlabelled = {"input_ids": [2, 7, 1], "labels": [-100, -100, -100]}
    for batch_size in (1, 2):
        builder = builder_for(model, theta0, replay=EQUAL, new_task=[labelled, unlabelled, labelled, unlabelled])
        candidate = ReplaySft(passes=1, loss="kl", new_task_weight=1.0, new_task_batch_size=batch_size)
        with pytest.raises(JanusError, match=r"2 new-task sample\(s\) have no token that carries loss \(at 1, 3, "):
            candidate.check(builder)
        assert all(torch.equal(builder.params[k].detach(), v) for k, v in builder.finetuned.items())
    builder = builder_for(model, theta0, replay=EQUAL, new_task=[labelled, labelled])
    ReplaySft(passes=1, loss="kl", new_task_weight=1.0, new_task_batch_size=2).check(builder)
    ReplaySft(passes=1, loss="kl").check(builder_for(model, theta0, replay=EQUAL, new_task=[unlabelled]))


def test_replay_fine_tuning_is_refused_where_its_optimizer_state_does_not_fit():
    """Before any work: the float32 master copy, its gradient and Adam's moments (SGD: no moments) of every changed
    parameter, and autograd's gradient in the parameter's dtype, against what the model's device has free."""
    model, theta0 = tiny_pair(seed=3)
    changed = sum(p.numel() for p in model.parameters())
    adam, sgd = changed * (16 + 4), changed * (8 + 4)
    asked = []

    def free(amount):
        def measure(device):
            asked.append(device)
            return amount
        return measure

    for amount, refused in ((adam - 1, ("adam",)), (sgd - 1, ("adam", "sgd")), (adam, ()), (None, ())):
        builder = builder_for(model, theta0, replay=EQUAL, free_memory=free(amount))
        for optimizer in ("adam", "sgd"):
            candidate = ReplaySft(passes=1, optimizer=optimizer)
            assert candidate.state_bytes(builder) == (adam if optimizer == "adam" else sgd)
            if optimizer in refused:
                with pytest.raises(JanusError, match=rf"replay-sft needs .* GiB on cpu for its {optimizer} state "
                                                     rf"over the {changed:,} changed parameters.*optimizer=sgd"):
                    candidate.check(builder)
            else:
                candidate.check(builder)
    assert asked and all(d == torch.device("cpu") for d in asked)
    assert all(torch.equal(p.detach(), builder.finetuned[k]) for k, p in model.named_parameters())


def test_the_frontier_leaves_out_a_default_peer_that_cannot_run_and_refuses_one_named(caplog):
    """A default peer whose optimizer state does not fit is left out with a warning, so that the defaults never stop
    a frontier; the same candidate named by the user is refused with its reason."""
    from hf_janus.evaluation.frontier_search import keep_defined

    model, theta0 = tiny_pair(seed=3)
    builder = builder_for(model, theta0, replay=EQUAL, free_memory=lambda device: 1)
    sft, wise = ReplaySft(passes=1), Wise(0.5)
    with caplog.at_level("WARNING", logger="hf_janus.evaluation.frontier_search"):
        assert keep_defined([wise, sft], builder, optional={sft}) == [wise]
    assert any(f"{sft.label} is left out: replay-sft needs" in r.getMessage() for r in caplog.records)
    with pytest.raises(JanusError, match="replay-sft needs .* GiB on cpu"):
        keep_defined([wise, sft], builder)


# ---- LiNeS, each block's scale written out -----------------------------------------------------------------------
@pytest.mark.parametrize("alpha,beta", [(0.0, 1.0), (0.3, 0.5)])
def test_lines_scales_each_block_by_depth(alpha, beta):
    tuned = build_tiny("gpt2")  # two blocks: transformer.h.0 and transformer.h.1
    reference = fine_tune(tuned)
    builder = builder_for(tuned, reference)
    weights, cost = built(Lines(alpha, beta), builder)
    assert cost.forward_passes == 0
    for key, t0 in builder.theta0.items():
        block = re.search(r"\.h\.(\d)\.", key)
        if block:
            scale = alpha + beta * int(block.group(1))  # L − 1 = 1
        else:  # embeddings come before the blocks, the final norm after them
            scale = alpha if key.startswith(("transformer.wte", "transformer.wpe")) else alpha + beta
        want = t0.double() + scale * (builder.finetuned[key].double() - t0.double())
        assert torch.allclose(weights[key].double(), want, atol=1e-6), key
    with pytest.raises(JanusError, match="alpha"):
        Lines(1.5, 0.0)


# ---- DG-Hard, against Gavish & Donoho in numpy --------------------------------------------------------------------
def dg_by_numpy(delta: np.ndarray) -> np.ndarray:
    u, s, vh = np.linalg.svd(delta, full_matrices=False)
    beta = min(delta.shape) / max(delta.shape)
    tau = (0.56 * beta ** 3 - 0.95 * beta ** 2 + 1.82 * beta + 1.43) * np.median(s)
    keep = s > tau
    return (u[:, keep] * s[keep]) @ vh[keep]


@pytest.mark.parametrize("shape", [(12, 12), (9, 20), (20, 7)])
def test_dg_hard_threshold_matches_numpy(shape):
    rng = np.random.default_rng(0)
    signal = 5 * np.outer(rng.standard_normal(shape[0]), rng.standard_normal(shape[1]))
    delta = signal + 0.1 * rng.standard_normal(shape)
    ours = hard_threshold(torch.tensor(delta))
    np.testing.assert_allclose(ours.numpy(), dg_by_numpy(delta), atol=1e-10)
    assert np.linalg.matrix_rank(ours.numpy(), tol=1e-8) < min(shape)  # the noise directions went
    assert omega(1.0) == pytest.approx(2.86)


def test_dg_hard_candidate_and_its_refusals():
    model, theta0 = tiny_pair(seed=4)
    builder = builder_for(model, theta0)
    weights, _ = built(DgHard(), builder)
    for key in ("hidden.weight", "head.weight"):
        want = np64(theta0[key]) + dg_by_numpy(np64(builder.finetuned[key]) - np64(theta0[key]))
        np.testing.assert_allclose(np64(weights[key]), want, atol=1e-5)
    assert torch.equal(weights["hidden.bias"], builder.finetuned["hidden.bias"])
    # an adapter's update is exactly of rank r: refused before any work, saying why
    lora = builder_for(model, theta0, adapter_ranks={"hidden.weight": 1, "head.weight": 1})
    with pytest.raises(JanusError, match="full fine-tuning.*rank r"):
        DgHard().check(lora)
    # and so is a merged low-rank update given as full weights
    low = {k: v.clone() for k, v in theta0.items()}
    low["head.weight"] = model.head.weight.detach() - torch.outer(torch.ones(VOCAB), torch.ones(HIDDEN))
    with pytest.raises(JanusError, match="low rank"):
        built(DgHard(), builder_for(model, low))


# ---- LoRA: WiSE-FT is PEFT's rescale_adapter_scale ----------------------------------------------------------------
def test_wise_on_a_lora_adapter_is_peft_rescale_adapter_scale():
    from peft import LoraConfig, get_peft_model
    from peft.helpers import rescale_adapter_scale
    from peft.tuners.lora import LoraLayer

    peft_model = get_peft_model(build_tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    layers = {n.removeprefix("base_model.model.") + ".weight": m for n, m in peft_model.named_modules()
              if isinstance(m, LoraLayer)}
    theta0 = {k: m.get_base_layer().weight.detach().clone() for k, m in layers.items()}
    tuned = copy.deepcopy(peft_model).merge_and_unload()
    finetuned = {k: tuned.get_parameter(k).detach().clone() for k in theta0}
    builder = WeightBuilder(tuned, theta0, finetuned, None, None, None)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    for a in (0.25, 0.5):
        with builder.applied(Wise(a)) as model, torch.no_grad():
            ours = model(ids).logits
        with rescale_adapter_scale(peft_model, a), torch.no_grad():
            theirs = peft_model(ids).logits
        assert torch.allclose(ours, theirs, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(peft_model(ids).logits, ours, atol=1e-4)  # the scale matters
