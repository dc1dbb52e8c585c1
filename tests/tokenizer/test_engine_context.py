"""The context length a tokenizer checks against (services/tokenizer/engine_context.py): its
own until an engine of its model announces, then the smallest of the live engines' and its own."""

from __future__ import annotations

from flotilla.libs.common.messages import Announcement
from flotilla.services.tokenizer.engine_context import EngineContext


def _engine(instance: str, length: int, model: str = "m") -> Announcement:
    return Announcement(service="engine", instance=instance, model=model, max_model_len=length)


def test_the_smallest_live_engine_length_wins_and_silent_engines_expire() -> None:
    context = EngineContext("m", own=8192, ttl_s=5.0)
    assert context.length(now=0.0) == 8192
    context.heard(_engine("e1", 1456), now=0.0)
    context.heard(_engine("e2", 4096), now=1.0)
    context.heard(_engine("other", 100, model="x"), now=1.0)  # another model's engine
    context.heard(Announcement(service="tokenizer", instance="t", model="m", max_model_len=64),
                  now=1.0)  # a tokenizer is no authority on the context
    assert context.length(now=2.0) == 1456
    assert context.length(now=5.5) == 4096  # e1 silent for longer than the TTL
    assert context.length(now=7.0) == 8192


def test_an_engine_never_raises_the_tokenizers_own_cap() -> None:
    context = EngineContext("m", own=2048, ttl_s=5.0)
    context.heard(_engine("e1", 8192), now=0.0)
    assert context.length(now=0.0) == 2048
