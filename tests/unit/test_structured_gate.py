"""A constraint gated on the end of reasoning: free text until `</think>`, then held."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_worker.sampling.structured import StructuredOutputs
from shared.model_source import ModelSource
from shared.protocol import Constraint


@pytest.fixture(scope="module")
def structured(smollm2_source: ModelSource) -> StructuredOutputs:
    return StructuredOutputs(smollm2_source, 49152, [2])


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.tokenize_str(text)


def test_the_constraint_starts_after_the_reasoning_tag(structured: StructuredOutputs) -> None:
    tokenizer = structured.tokenizer
    constraint = Constraint(kind="regex", spec=r"[A-Z][a-z]{2,10}\.", start_after="</think>")
    matcher = structured.new_matcher(constraint, [1, 2, 3])
    reasoning = _ids(tokenizer, "<think>free text, even 123 {}!")
    matcher.sync(reasoning)
    assert not matcher.is_active
    assert matcher.error is None
    output = reasoning + _ids(tokenizer, "</think>")
    matcher.sync(output)
    assert matcher.is_active
    assert not matcher.is_stopped
    output += _ids(tokenizer, "Paris.")
    matcher.sync(output)
    assert matcher.error is None
    assert matcher.is_stopped


def test_without_a_gate_the_constraint_holds_from_the_first_token(
    structured: StructuredOutputs,
) -> None:
    tokenizer = structured.tokenizer
    matcher = structured.new_matcher(Constraint(kind="regex", spec=r"[A-Z][a-z]{2,10}\."), [1])
    assert matcher.is_active
    matcher.sync(_ids(tokenizer, "<think>"))
    assert matcher.error is not None  # "<" is outside the grammar
