"""Fixtures shared by every test package; the helpers they use live in ``testing_utils``."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from testing_utils import build_tiny, fine_tune  # noqa: E402  (after the environment the libraries read)


@pytest.fixture
def tuned_llama():
    model = build_tiny("llama")
    reference = fine_tune(model)
    return model, reference


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Runs the test twice, at 1 and at 2 torch threads, whatever OMP_NUM_THREADS says: with two threads CPU
    kernels split their sums and reduce them in another order (and may pick other kernels), so a float32 bound that
    holds for one order only fails here, not on a newcomer's machine. For the numeric tests
    (``@pytest.mark.usefixtures("torch_threads")``); two threads on one core only run slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)
