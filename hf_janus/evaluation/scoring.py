"""Scores of the paper's metrics: SQuAD exact match of generated answers, and AP1/AP2/AP (Sec. 4.1, "Metrics").

AP1 is what a model keeps of the past tasks relative to θ0, AP2 what it keeps of the new task relative to the
fine-tuned θ̂, AP their mean. The paper's scores are accuracies (higher is better): a task's share is then
``score / score_of_anchor``. Loss-like scores (lower is better, e.g. a negative log-likelihood) are shares of the
*change* instead: AP1 = the share of the loss rise that fine-tuning caused and the model undoes, AP2 = the share
of the loss drop on the new task that it keeps. Both are 100 at their anchor, and AP1 is 0 at θ̂ for a loss.
"""

from __future__ import annotations

import math
import re
import string
from typing import Iterable, Mapping, Optional, Sequence

from hf_janus.errors import JanusError

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if the normalized prediction equals any normalized reference answer, else 0.0."""
    guess = normalize_answer(prediction)
    return float(any(guess == normalize_answer(a) for a in answers))


def first_line(generation: str) -> str:
    """The answer in a greedy continuation: its first line, stripped (the benchmark's and lm-eval's NQ reading)."""
    return generation.split("\n")[0].strip()


def task_share(score: float, anchor: float, other: float, higher_is_better: bool, *, what: str,
               side: str = "AP1") -> float:
    """One task's share (%) of AP1 or AP2.

    Args:
        score: the model's score.
        anchor: the score AP is relative to (θ0 for AP1, θ̂ for AP2).
        other: the other end (θ̂ for AP1, θ0 for AP2); only used for loss-like scores.
        higher_is_better: accuracy-like (share of the anchor) or loss-like (share of the change).
        what: the task's name, for errors.
        side: ``"AP1"`` or ``"AP2"``, for errors.
    """
    if higher_is_better:
        if anchor == 0:
            raise JanusError(f"{what}: the anchor model scores 0, so a share of its score is undefined; pick a task "
                             "the anchor model scores above 0 on")
        return 100.0 * score / anchor
    if other - anchor <= 0:  # a share of a change that did not happen (or went the other way) means nothing
        theta0, theta_hat = (anchor, other) if side == "AP1" else (other, anchor)
        expected = "raised (forgetting)" if side == "AP1" else "lowered (learning)"
        raise JanusError(f"{what}: its loss goes from {theta0:.6g} at θ0 to {theta_hat:.6g} at θ̂, so {side} (the "
                         f"share of the change kept or undone) is undefined: a loss-like {side} task needs a loss "
                         f"that fine-tuning {expected}; pick another task")
    return 100.0 * (other - score) / (other - anchor)


def ap_metrics(scores: Mapping[str, float], reference: Mapping[str, float], finetuned: Mapping[str, float],
               past_tasks: Sequence[str], new_tasks: Sequence[str],
               higher_is_better: Mapping[str, bool]) -> dict[str, Optional[float]]:
    """AP1 (mean share over ``past_tasks``, relative to θ0), AP2 (over ``new_tasks``, relative to θ̂), AP.

    A side without tasks gives ``None``; AP is then ``None`` too.
    """
    def mean_share(tasks: Sequence[str], anchor: Mapping[str, float], other: Mapping[str, float],
                   side: str) -> Optional[float]:
        if not tasks:
            return None
        shares = [task_share(scores[t], anchor[t], other[t], higher_is_better[t], what=t, side=side) for t in tasks]
        return sum(shares) / len(shares)

    ap1 = mean_share(past_tasks, reference, finetuned, "AP1")
    ap2 = mean_share(new_tasks, finetuned, reference, "AP2")
    ap = 0.5 * (ap1 + ap2) if ap1 is not None and ap2 is not None else None
    return {"ap1": ap1, "ap2": ap2, "ap": ap}


def weighted_nll(pairs: Iterable[tuple[float, int]]) -> float:
    """Σ(−log-likelihood) / Σ(weight): lm-eval aggregation of a completion task's per-document (ll, bytes)."""
    total, count = 0.0, 0
    for loglik, weight in pairs:
        total -= loglik
        count += weight
    return total / count if count else math.nan
