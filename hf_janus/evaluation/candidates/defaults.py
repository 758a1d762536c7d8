"""What :func:`hf_janus.frontier` scores when it is not told: every kind's default grid (each kind's options carry
their defaults), plain JANUS at three τ, and the post-hoc peers that beat JANUS somewhere in the benchmarks."""

from __future__ import annotations

from hf_janus.evaluation.candidates.janus import DEFAULT_TAUS

#: WiSE-FT, PEFT's intruder reduction (LoRA adapters only: left out elsewhere), JANUS at each of
#: :data:`~hf_janus.evaluation.candidates.janus.DEFAULT_TAUS`, damped JANUS and the hybrids, at their kinds' defaults
DEFAULT_GRID = ("wise intruder janus:tau=" + ",".join(f"{t:g}" for t in DEFAULT_TAUS)
                + " damped-janus janus-to-reference janus-to-finetuned wise-then-janus intruder-then-janus")
# Replay fine-tuning on the KL to θ0 at 4× JANUS's evaluations, Fisher-weighted interpolation and the input-covariance
# null space: each lies above JANUS at its defaults, or level with it, on a benchmark run (benchmarks/forgetting/
# README.md), at a cost of the order of one JANUS run (replay SFT), one Jacobian evaluation (Fisher) or one forward
# pass over the replay (the null space, shared by its two points).
DEFAULT_PEERS = "replay-sft:budget=4:loss=kl fisher:strength=1 input-null:energy=0.5,0.9"
# JANUS with the repair after it (the engine's stage, JanusConfig.distill_steps): it needs the new task's samples, so
# only a frontier given them adds it.
NEW_TASK_PEERS = "janus-repair"


def default_peers(new_task_samples: bool) -> str:
    """The post-hoc peers the frontier scores by default: :data:`DEFAULT_PEERS`, and :data:`NEW_TASK_PEERS` when the
    new task's samples were given (the candidates that fit them)."""
    return DEFAULT_PEERS + (" " + NEW_TASK_PEERS if new_task_samples else "")


def default_candidates(new_task_samples: bool) -> str:
    """The spec of the frontier's default candidates: :data:`DEFAULT_GRID`, then :func:`default_peers`."""
    return DEFAULT_GRID + " " + default_peers(new_task_samples)
