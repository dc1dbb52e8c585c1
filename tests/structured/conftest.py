"""Shared fixtures: the SmolLM2 vocabulary and its grammar compiler (the engine's, without a
model: tests drive the real sampler with stand-in logits)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.services.engine.structured import StructuredOutputs
from flotilla.services.tokenizer.grammar_check import xgrammar
from flotilla.services.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session", autouse=True)
def grammar_engine_loaded() -> None:
    """xgrammar imported once, as every service's warm-up does before it serves (the import
    takes seconds, which timing assertions must not count)."""
    xgrammar()


@pytest.fixture(scope="session")
def outputs(smollm2_path: Path, smollm2: Tokenizer) -> StructuredOutputs:
    return StructuredOutputs(str(smollm2_path), smollm2.vocab_size,
                             smollm2.end_of_generation_ids())
