"""Fixtures shared by every test package; the helpers they use live in ``testing_utils``."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from testing_utils import build_tiny, fine_tune  # noqa: E402  (after the environment the libraries read)


@pytest.fixture
def tuned_llama():
    model = build_tiny("llama")
    reference = fine_tune(model)
    return model, reference
