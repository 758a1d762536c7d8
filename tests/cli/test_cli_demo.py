"""`hf-janus demo` and the top-level CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from hf_janus import RectificationReport
from hf_janus.cli import main


def test_demo_quick_single_step(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert main(["demo", "--quick", "--tau", "0", "--no-progress", "--report", str(report_path)]) == 0
    out = capsys.readouterr().out
    for row in ("pretrained θ0", "fine-tuned θ̂", "JANUS-rectified", "replay loss"):
        assert row in out
    report = RectificationReport.load(report_path)
    assert report.config["tau"] == 0.0 and report.alphas == [1.0]
    loss = report.replay_loss
    # Forgetting happened and the single projected step gave part of it back on the replayed task.
    assert loss["finetuned"] > loss["reference"]
    assert loss["rectified"] < loss["finetuned"]


def test_demo_budget_stops_cleanly(tmp_path, capsys):
    """The demo's rectifications obey --max-evaluations: the run ends, at the last accepted point, and says so;
    with --require-converged (what CI runs) that is exit status 1."""
    report_path = tmp_path / "report.json"
    assert main(["demo", "--quick", "--no-lora", "--max-evaluations", "3", "--no-progress", "--require-converged",
                 "--report", str(report_path)]) == 1
    report = RectificationReport.load(report_path)
    assert report.config["max_evaluations"] == 3 and report.config["step_control"] == "adaptive"
    # Unbudgeted, this rectification converges after 32 evaluations: 3 must be what stopped it, after exactly 3, and
    # the run must say so rather than claim convergence.
    assert report.stopped_early and not report.converged
    assert report.stop_reason == "budget: max_evaluations=3 reached"
    assert report.num_jacobian_evals == 3
    if not report.steps:  # no step accepted within the budget: the last accepted point is θ0
        assert report.replay_loss["rectified"] == pytest.approx(report.replay_loss["reference"], rel=1e-6)
    out = capsys.readouterr()
    assert "budget: max_evaluations=3 reached" in out.out
    assert "the full fine-tuning rectification did not converge" in out.err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "JANUS" in out and "--version" in out and "--verbose" in out
    for command in ("demo", "merge", "eval", "frontier"):
        # a line of the subcommand list, not a word of some help text ("eval" is in "evaluation")
        assert re.search(rf"^ +{command} +\S", out, re.MULTILINE), command
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--quick", "--no-lora", "--seed", "--tau", "--compression-rank", "--step-control",
                   "{adaptive,paper}",
                   "--max-evaluations", "--report", "--no-progress"):
        assert option in out, option


def test_invalid_config_value_is_a_clean_error(capsys):
    assert main(["demo", "--quick", "--tau", "1.5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "tau" in err and "[0, 1]" in err


def test_console_script_module_entry():
    out = subprocess.run([sys.executable, "-m", "hf_janus.cli", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.startswith("hf-janus ")
