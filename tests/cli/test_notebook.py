"""``notebooks/quickstart.ipynb`` executes top to bottom in a fresh kernel (nbclient), offline, and tells the story
it promises: forgetting, then a repair. From a clone the push goes to the local test Hub; run where there is no
clone (hf-janus installed from a wheel) the adapter goes to a folder instead. The notebook is stored with its outputs,
so that GitHub and the Hub show them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"

# Appended to the executed copy only: print what the cells computed, for the assertions below.
PROBE = """
import json
print("PROBE" + json.dumps({
    "results": results, "lora_results": lora_results, "pulled": pulled, "where": where,
    "replay_loss": janus.report.replay_loss, "lora_replay_loss": delta.report.rectification.replay_loss,
}))
"""


def test_the_stored_notebook_shows_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "store it executed, with its outputs"


@pytest.mark.slow
@pytest.mark.parametrize("installed", [False, True], ids=["clone", "installed"])
def test_quickstart_notebook_executes(monkeypatch, tmp_path, installed):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this environment: no token and offline, so nothing goes to the real Hub.
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    where = tmp_path if installed else NOTEBOOK.parent  # outside a clone, tests/hub_server.py cannot be found
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(where)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot cell produced no figure"
    probe = next(o["text"] for o in outputs if o.get("name") == "stdout" and "PROBE" in o.get("text", ""))
    got = json.loads(probe.split("PROBE", 1)[1])

    past, new = "past task NLL ↓", "new task NLL ↓"
    table = got["results"]
    assert list(table) == ["pretrained θ0", "fine-tuned θ̂", "JANUS-rectified"]
    # Fine-tuning learned the new task and forgot the past one (held-out pairs) ...
    assert table["fine-tuned θ̂"][new] < table["pretrained θ0"][new]
    assert table["fine-tuned θ̂"][past] > table["pretrained θ0"][past] + 0.5
    # ... and JANUS gave part of the past task back, on the replayed pairs and on pairs it never saw.
    assert got["replay_loss"]["rectified"] < got["replay_loss"]["finetuned"]
    assert table["JANUS-rectified"][past] < table["fine-tuned θ̂"][past]
    lora = got["lora_results"]
    assert got["lora_replay_loss"]["rectified"] < got["lora_replay_loss"]["finetuned"]
    assert lora["LoRA + JANUS (rank-8 adapter)"][past] < lora["LoRA r=8 fine-tuned"][past]
    # The adapter pulled back from the (local) Hub, or the folder, is the one that was saved.
    assert got["where"].startswith("a local folder" if installed else "the local test Hub")
    assert got["pulled"][past] == pytest.approx(lora["LoRA + JANUS (rank-8 adapter)"][past], abs=1e-4)
