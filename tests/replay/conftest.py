"""Fixtures of the self-replay tests: a tiny Llama (θ0) and the character tokenizer whose ids fit it."""

from __future__ import annotations

import pytest
from merge_fixtures import char_tokenizer
from testing_utils import build_tiny


@pytest.fixture
def model():
    return build_tiny("llama")


@pytest.fixture
def tok():
    return char_tokenizer()
