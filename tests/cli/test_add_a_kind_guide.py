"""docs/guides/add-a-kind.md as a newcomer follows it: its three examples run as written, in a process of their own
(they register kinds, which a registry keeps), and each kind then works where it is meant to: the candidate builds its
weights, the acceptance rule and the constraint rectify a tiny model and the model card names them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "add-a-kind.md"

CHECKS = '''
import copy
import torch
from testing_utils import build_tiny, random_replay
from hf_janus import rectify
from hf_janus.evaluation.candidate_weights import WeightBuilder
from hf_janus.publish.card import render_card
from hf_janus.publish.record_file import PublishedReport

theta0 = build_tiny("llama", seed=0)
tuned = copy.deepcopy(theta0)
with torch.no_grad():
    for p in tuned.parameters():
        p.add_(0.02 * torch.randn_like(p))
params = dict(tuned.named_parameters())
builder = WeightBuilder(tuned, {k: p.detach().clone() for k, p in theta0.named_parameters()},
                        {k: p.detach().clone() for k, p in params.items()}, None, None, random_replay(4))
weights = AttentionWise(0.5).weights(builder)
for name, w in weights.items():
    w0, w1 = builder.theta0[name], builder.finetuned[name]
    assert torch.equal(w, w0 + 0.5 * (w1 - w0) if ".self_attn." in name else w1), name
assert any(".self_attn." in name for name in weights)

for fields, shown in ((dict(acceptance="cosine-or-lower", tau=0.95), "acceptance=cosine-or-lower"),
                      (dict(constraint="first_tokens_loss", constraint_options={"count": 2}),
                       "constraint=first\\\\_tokens\\\\_loss, constraint\\\\_options=\\\\(count=2\\\\)")):
    model = copy.deepcopy(tuned)
    report = rectify(model, theta0, random_replay(8), JanusConfig(compression_rank=4, max_steps=3, **fields),
                     progress=False)
    assert report.steps and any(not torch.equal(a, b) for a, b in zip(model.parameters(), tuned.parameters()))
    card = str(render_card(PublishedReport(kind="full", rectification=report), load_id="me/m"))
    other = next(line for line in card.splitlines() if line.startswith("| other settings |"))
    assert shown in other, other
try:
    JanusConfig(constraint="first_tokens_loss", constraint_options={"count": 0})
    raise AssertionError("count=0 accepted")
except ValueError as refused:
    assert "count" in str(refused)
print("guide kinds work")
'''


def test_the_guides_examples_run_and_make_working_kinds():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) == 3
    script = "\n\n".join(blocks) + CHECKS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "guide kinds work" in done.stdout
    assert "AttentionWise(a=0.25)" in done.stdout  # the spec's default grid, printed by the first example
