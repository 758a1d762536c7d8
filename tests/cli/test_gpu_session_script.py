"""benchmarks/perf/gpu_scale_session.sh works before a GPU call is spent on it: its phases run on the CPU at tiny
sizes (JANUS_GPU_SESSION_DEVICE=cpu, JANUS_GPU_SESSION_TINY=1), each leaves $OUT/<phase>.json and the
$OUT/<phase>.partial.json it rewrote while running, with the figures the GPU session is for, and a phase killed at
its time limit still leaves its partial figures while the next phase runs.

No test here depends on how fast the machine is: the kill test fires the phase's time limit itself, on an event (its
partial figures show an evaluation), not after a number of seconds."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil  # a dependency of deepspeed (the test extra)
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "perf" / "gpu_scale_session.sh"
# The phases' time limits here, far above what any phase takes (20-50 s on 2 cores), so that only a hung phase meets
# them: the session's own limits (560 s a call, 150 s for smoke) are for the GPU. The kill test ends the smoke phase
# itself, as its limit would, once the phase has evaluated once (~10 s on an idle 2-core machine); the run it cuts
# (100000 evaluations) would take hours.
PHASE_LIMIT_S = 3600
SMOKE_LIMIT_S = 1800

pytestmark = pytest.mark.slow  # each test runs two phases in fresh interpreters: 20-50 s


def session_env(tmp_path: Path, **env: str) -> dict[str, str]:
    return {**os.environ, "OUT": str(tmp_path / "out"), "CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable,
            "JANUS_GPU_SESSION_DEVICE": "cpu", "JANUS_GPU_SESSION_TINY": "1", "OMP_NUM_THREADS": "1",
            "PHASE_LIMIT_S": str(PHASE_LIMIT_S), **env}


def run_session(tmp_path: Path, *phases: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    proc = subprocess.run(["bash", str(SCRIPT), *phases], capture_output=True, text=True,
                          env=session_env(tmp_path, **env))
    return proc, tmp_path / "out"


def read(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"{path.name} was not written"
    return json.loads(path.read_text(encoding="utf-8"))


def assert_finite(value: Any, where: str = "") -> None:
    """Every number in a JSON value is finite (None stands for "not measured here", e.g. the GPU peak on a CPU)."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            assert_finite(item, f"{where}[{i}]")
    elif isinstance(value, float):
        assert math.isfinite(value), f"{where} = {value}"


def shows_an_evaluation(path: Path) -> bool:
    """The partial JSON (written atomically) holds what :func:`assert_partial` checks."""
    try:
        assert_partial(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, AssertionError):
        return False
    return True


def descendants(session: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(session.pid).children(recursive=True)
    except psutil.Error:  # the session has ended
        return []


def fire_time_limit(session: subprocess.Popen) -> None:
    """What the phase's time limit does when it runs out: ``timeout``'s timer sends it SIGALRM, on which it sends
    SIGTERM to the phase and exits with 124 (the kill grace and SIGKILL after it included)."""
    def name(process: psutil.Process) -> str:
        try:
            return process.name()
        except psutil.Error:  # a short-lived helper (date, mktemp) that has just exited
            return ""

    (timer,) = [p for p in descendants(session) if name(p) == "timeout"]
    timer.send_signal(signal.SIGALRM)


def assert_partial(partial: dict[str, Any]) -> None:
    """The figures a partial JSON holds once the rectification has run a while."""
    assert partial["evaluations"] >= 1
    assert partial["elapsed_s"] > 0 and partial["peak_host_gib"] > 0
    assert {"capture", "project"} <= set(partial["sections_s"]) and partial["section_calls"]["capture"] >= 1
    assert partial["predicted_peak_host_gib"] > 0 and partial["captures"] in ("all", "two")
    assert partial["placements"]["factors"] in ("host", "disk", "device")
    assert_finite(partial)


def test_phases_write_results_and_partial_figures(tmp_path):
    proc, out = run_session(tmp_path, "env", "7b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = read(out / "env.json")
    assert env["status"] == "done" and env["packages"]["torch"] and env["cache_free_gib"] > 0
    assert (out / "env.txt").is_file() and (out / "session.log").is_file()

    result = read(out / "7b.json")
    assert result["status"] == "done"
    (row,) = result["runs"]
    assert row["evaluations"] == 4 and row["device"] == "cpu" and row["peak_gpu_gib"] is None
    for key in ("f_s", "r_eval", "r", "total_s", "seconds_per_eval", "peak_host_gib", "predicted_peak_host_gib",
                "predicted_disk_gib"):
        assert isinstance(row[key], float) and row[key] >= 0, key
    assert row["captures"] in ("all", "two") and row["captures_alive"] in (2, 3, 4)
    assert 1 <= row["peak_captures"] <= row["captures_alive"] and row["recaptures"] >= 0
    assert set(row["targets"]) == {"r_eval_max", "four_evaluations_max_s", "peak_gpu_max_gib"}
    assert row["met"]["r_eval"] == (row["r_eval"] <= row["targets"]["r_eval_max"])
    assert row["met"]["peak_gpu_gib"] is None  # no GPU here
    assert_finite(result)

    partial = read(out / "7b.partial.json")
    assert partial["stage"] == "done" and partial["evaluations"] == 4 and partial["f_s"] > 0
    assert_partial(partial)
    assert not (tmp_path / "cache" / "7b").exists()  # the phase's spill directory is gone


def test_a_killed_phase_leaves_its_partial_figures_and_the_next_phase_runs(tmp_path):
    env = session_env(tmp_path, SMOKE_LIMIT_S=str(SMOKE_LIMIT_S), JANUS_GPU_SESSION_EVALS="100000")
    out, log = tmp_path / "out", tmp_path / "session.out"  # a file, not a pipe: nothing blocks while it waits
    with log.open("w") as sink, subprocess.Popen(["bash", str(SCRIPT), "smoke", "qlora"], stdout=sink,
                                                 stderr=subprocess.STDOUT, text=True, env=env) as session:
        try:
            # polled, not timed: the wait ends on the event, or when the session ends without it (a failed phase)
            while session.poll() is None and not shows_an_evaluation(out / "smoke.partial.json"):
                time.sleep(0.2)
            assert session.poll() is None, log.read_text()[-6000:]
            fire_time_limit(session)
        except BaseException:  # not the next half hour waiting for the phases' own limits
            for process in descendants(session):
                with contextlib.suppress(psutil.Error):  # it ended meanwhile
                    process.kill()
            session.kill()
            raise
        returncode = session.wait()
    output = log.read_text()
    assert returncode == 1, output[-6000:]  # a phase did not finish

    killed = read(out / "smoke.json")
    assert killed["status"] == "timeout" and killed["exit_code"] == 124 and killed["limit_s"] == SMOKE_LIMIT_S
    partial = read(out / "smoke.partial.json")
    assert partial["stage"].startswith("killed by SIGTERM")
    assert killed["partial"] == partial  # the result file carries the partial figures
    assert_partial(partial)

    qlora = read(out / "qlora.json")
    assert qlora["status"] == "done" and qlora["met"] == {"nf4_peak_gpu_gib": None}
    (run,) = qlora["runs"]
    assert run["quant"] == "nf4" and run["output"] == "none" and run["batch_size"] == 4 and run["jacobian_evals"] >= 1
    assert run["seconds_per_eval"] > 0 and run["peak_host_gib"] > 0 and run["peak_gpu_gib"] is None
    assert run["captures"] in ("all", "two") and run["predicted_peak_host_gib"] > 0
    assert_finite(qlora)
    qlora_partial = read(out / "qlora.partial.json")
    assert qlora_partial["stage"] == "done"
    assert_partial(qlora_partial)
    assert not (tmp_path / "cache" / "qlora").exists()  # the saved model and spilled factors are gone
