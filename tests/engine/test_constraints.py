"""The replay constraints as objects (hf_janus.engine.constraints): the token_loss constraint's rows against
explicit per-token Jacobians (torch.func), its rows' sum against the paper's loss, the registry, the configuration's
validation and the model card's naming of a constraint's options."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from testing_utils import VOCAB, build_tiny, fine_tune, random_replay

from hf_janus import JanusConfig, rectify
from hf_janus.engine.constraints import (Constraint, ReplayLogits, TokenLossConstraint, constraint_names,
                                         make_constraint, per_token_cross_entropy, register)
from hf_janus.errors import JanusError
from hf_janus.replay.prepare import IGNORE_INDEX


def answer_replay(lengths: list[int], prompt: int = 4, seed: int = 3) -> list[dict]:
    """Prompt + answer samples whose labels cover the answer only, with answers of the given token counts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (prompt + n,), generator=gen).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                    "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def explicit_token_rows(model, weights: dict, sample: dict, k: int) -> list[dict]:
    """The k + 1 functions of constraint='token_loss' for one sample, written out independently: the cross-entropy
    of each of its first k answer tokens alone, then the sum over the rest; their gradients (torch.func) w.r.t. each
    layer weight in ``weights``: a list of ``{layer: (d_out, d_in)}``."""
    from torch.func import functional_call, grad

    params = {n: v.detach() for n, v in model.named_parameters()}
    ids = torch.tensor([sample["input_ids"]])
    answer = [t for t, label in enumerate(sample["labels"]) if label != IGNORE_INDEX]  # positions predicted

    def token_loss(positions):
        def value(target_params):
            logits = functional_call(model, {**params, **target_params}, kwargs={"input_ids": ids}).logits[0]
            total = logits.new_zeros(())
            for t in positions:  # logits at t - 1 predict token t
                total = total + F.cross_entropy(logits[t - 1], ids[0, t])
            return total
        return value

    groups = [answer[j:j + 1] for j in range(k)] + [answer[k:]]
    out = []
    for positions in groups:
        g = grad(token_loss(positions))({f"{n}.weight": w for n, w in weights.items()})
        out.append({n: g[f"{n}.weight"] for n in weights})
    return out


def test_token_rows_sum_to_the_sample_loss():
    """The k + 1 rows of each sample add up to its summed loss (so the paper's constraint stays in their span), each
    of the first k rows is one token's loss, and a sample with fewer tokens has zero rows past its last."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 6, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (3, 6), generator=gen)
    targets[0, :2] = IGNORE_INDEX  # a prompt: 4 answer tokens
    targets[1, :5] = IGNORE_INDEX  # a 1-token answer
    view = ReplayLogits(scores, targets, per_token_cross_entropy(scores, targets))
    rows = TokenLossConstraint(3).functions(view)
    assert rows.shape == (3, 4)
    torch.testing.assert_close(rows.sum(dim=1), view.per_token.sum(dim=1))
    torch.testing.assert_close(rows[0, :3], view.per_token[0, 2:5])
    torch.testing.assert_close(rows[0, 3], view.per_token[0, 5])
    assert rows[1, 0] == view.per_token[1, 5] and torch.all(rows[1, 1:] == 0)
    torch.testing.assert_close(rows[2, 3], view.per_token[2, 3:].sum())


@pytest.mark.usefixtures("torch_threads")
def test_token_loss_keeps_each_early_token_unchanged(tuned_llama):
    """constraint='token_loss' (k=2): single-step JANUS puts each layer's update in the null space of every sample's
    per-token loss gradients (its first 2 answer tokens alone, and the rest of its answer), explicit with torch.func,
    including an answer of 1 token (its zero rows are ignored); the paper's loss constraint does not."""
    model, reference = tuned_llama
    replay = answer_replay([5, 1, 3, 6])
    k = 2
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
    theta0 = {n: reference[f"{n}.weight"].double() for n in names}
    probe = copy.deepcopy(model).double().eval()
    rows = [row for sample in replay for row in explicit_token_rows(probe, theta0, sample, k)]
    jac = {n: torch.stack([row[n].reshape(-1) for row in rows]) for n in names}
    assert all(float(jac[n][4:6].norm()) == 0 for n in names)  # the 1-token answer's rows past its token
    residuals = {}
    token_loss = {"constraint": "token_loss", "constraint_options": {"tokens": k}}
    for label, fields in (("token_loss", token_loss), ("paper", {})):
        rectified = copy.deepcopy(model)
        report = rectify(rectified, reference, replay, JanusConfig(tau=0.0, compression_rank=None, **fields),
                         progress=False)
        assert report.converged and report.config["constraint"] == fields.get("constraint", "loss")
        worst = 0.0
        for n in names:
            delta = rectified.get_submodule(n).weight.detach().double() - theta0[n]
            worst = max(worst, float((jac[n] @ delta.reshape(-1)).norm() / (jac[n].norm() * delta.norm())))
        residuals[label] = worst
    assert residuals["token_loss"] < 1e-6, residuals
    assert residuals["paper"] > 100 * residuals["token_loss"], residuals


def test_token_loss_through_compression_and_steps(tuned_llama):
    """The token rows through the sequence compression: at a rank that covers every position the single step is
    the exact one; and multi-step, with a 1-token answer's zero rows, every trial's cosine is a number."""
    model, reference = tuned_llama
    replay = answer_replay([6, 1, 4, 7, 3, 5], seed=4)
    weights = {}
    for rank in (None, 16):
        out = copy.deepcopy(model)
        rectify(out, reference, replay, JanusConfig(constraint="token_loss", tau=0.0, compression_rank=rank),
                progress=False)
        weights[rank] = {n: p.detach().double() for n, p in out.named_parameters()}
    for name, exact in weights[None].items():
        torch.testing.assert_close(weights[16][name], exact, rtol=1e-5, atol=1e-6)
    report = rectify(model, reference, replay, JanusConfig(constraint="token_loss", compression_rank=4, max_steps=4),
                     progress=False)
    cosines = [t.mean_cosine for step in report.steps for t in step.trials if not step.forced]
    assert cosines and all(math.isfinite(c) for c in cosines), cosines


def test_constraint_registry_and_validation():
    assert constraint_names()[:4] == ("loss", "target_logit", "logit_projections", "token_loss")
    assert make_constraint(JanusConfig(constraint="token_loss", constraint_options={"tokens": 5})).rows_per_sample == 6
    projections = make_constraint({"constraint": "logit_projections", "constraint_options": {"projections": 3},
                                   "seed": 1})
    assert (projections.rows_per_sample, projections.seed) == (3, 1)
    assert make_constraint(JanusConfig()).rows_per_sample == 1
    assert make_constraint(JanusConfig(constraint="token_loss")).rows_per_sample == 4  # the option's default
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"constraint_options\['tokens'\].*token_loss.*an int >= 1"):
            JanusConfig(constraint="token_loss", constraint_options={"tokens": bad})
    # an option of another kind, or none: the error names the kind's own options
    with pytest.raises(JanusError, match="'token_loss' has no option 'temperature'.*its options are 'tokens'"):
        JanusConfig(constraint="token_loss", constraint_options={"temperature": 2.0})
    with pytest.raises(JanusError, match="did you mean 'tokens'"):
        JanusConfig(constraint="token_loss", constraint_options={"token": 2})
    with pytest.raises(JanusError, match="takes no options"):
        JanusConfig(constraint="target_logit", constraint_options={"temperature": 2.0})
    with pytest.raises(JanusError, match="did you mean 'constraint_options'"):
        JanusConfig(constraint_tokens=2)
    # a config's options are its own: changing the dict given afterwards changes nothing
    given = {"tokens": 2}
    config = JanusConfig(constraint="token_loss", constraint_options=given)
    given["tokens"] = 0
    assert config.constraint_options == {"tokens": 2}
    assert JanusConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="token_loss"):
        JanusConfig(constraint="tokens")
    with pytest.raises(JanusError, match="already registered"):
        class Impostor(Constraint):
            name, summary = "loss", "not the paper's"

            def functions(self, batch):
                return batch.per_token.sum(dim=1)

        register(Impostor)
    with pytest.raises(JanusError, match="subclass"):
        register(object)


def test_a_registered_constraint_with_an_option_is_one_module_and_its_test():
    """A user's constraint with one option, declared beside it and registered before the config that names it:
    validation checks the option, the configuration's help lists it, the capture asks the kind for its functions and
    rows, a single step keeps them (here: the loss of each sample's last ``count`` counted tokens), and the card
    names the kind and its option."""
    from hf_janus.kinds import KindOption, is_int
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import PublishedReport

    @register  # the registry outlives the test: the name is one no other test uses
    class LastTokens(Constraint):
        name, summary = "test-last-tokens", "the loss of each sample's last count counted tokens"
        options = (KindOption("count", 1, "how many of the last tokens", lambda n: is_int(n) and n >= 1,
                              "an int >= 1"),)

        def __init__(self, count: int = 1):
            self.count = count

        def functions(self, batch):
            order = batch.counted.long().cumsum(dim=1)
            last = batch.counted & (order > order[:, -1:] - self.count)
            return torch.where(last, batch.per_token, torch.zeros(())).sum(dim=1)

    assert "test-last-tokens" in constraint_names()
    assert make_constraint(JanusConfig(constraint="test-last-tokens")).count == 1
    with pytest.raises(ValueError, match=r"constraint_options\['count'\]=0 .*test-last-tokens.*an int >= 1"):
        JanusConfig(constraint="test-last-tokens", constraint_options={"count": 0})
    tiny = build_tiny("llama")
    reference = fine_tune(tiny)
    config = JanusConfig(constraint="test-last-tokens", constraint_options={"count": 2}, tau=0.0)
    report = rectify(tiny, reference, random_replay(4), config, progress=False)
    assert report.converged and report.config["constraint_options"] == {"count": 2}
    card = str(render_card(PublishedReport(kind="full", rectification=report), load_id="me/m"))
    assert ("| other settings | constraint=test-last-tokens, constraint\\_options=\\(count=2\\) |"
            in card.splitlines())


def test_card_names_the_options_of_the_constraint_used():
    from hf_janus import RectificationReport
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import PublishedReport

    def settings(**fields):
        rect = RectificationReport(config=JanusConfig(**fields).to_dict())
        card = str(render_card(PublishedReport(kind="full", rectification=rect), load_id="me/m"))
        return [line for line in card.splitlines() if line.startswith("| other settings |")]

    assert settings(constraint="token_loss", constraint_options={"tokens": 5}) == [
        "| other settings | constraint=token\\_loss, constraint\\_options=\\(tokens=5\\) |"]
    assert settings(constraint="token_loss") == ["| other settings | constraint=token\\_loss |"]


def test_a_kinds_options_from_the_command_line():
    """``--constraint-options`` text: each value read as JSON where it is JSON, kept as text otherwise; an item that
    is not name=value is refused; no text is no options."""
    from hf_janus.kinds import parse_options

    assert parse_options("tokens=2, temperature=0.5,flag=true,name=abc") == {
        "tokens": 2, "temperature": 0.5, "flag": True, "name": "abc"}
    assert parse_options("") == {} and parse_options(" , ") == {}
    for bad in ("tokens", "=2", "tokens=2,k"):
        with pytest.raises(ValueError, match="not name=value"):
            parse_options(bad)
    # the parsed text builds the constraint it names, with the option's type checked by the kind
    config = JanusConfig(constraint="token_loss", constraint_options=parse_options("tokens=2"))
    assert make_constraint(config).rows_per_sample == 3
    with pytest.raises(ValueError, match="an int >= 1"):
        JanusConfig(constraint="token_loss", constraint_options=parse_options("tokens=two"))
