"""`reasoning_effort` (none | minimal | low | medium | high) mapped onto what each chat template
reads, found from the template itself (its undeclared variables and its string literals).

Rules, in order (every one that applies is used):
- the template reads `reasoning_effort` (gpt-oss, Tencent Hy3, Solar Open, Cohere Command A
  reasoning, DeepSeek V4): it gets the level, moved to the nearest level the template's text
  names when it names several (it checks the value then; otherwise the level passes as it is,
  `minimal` as `low` unless the template names it); `none` becomes `no_think` where the
  template names that (Hy3), `none` where it names that or has a thinking switch, else its
  lowest named level (Solar Open: no reasoning at minimal / low); a template with none of
  these (gpt-oss) refuses `none` (400), as the model cannot stop reasoning;
- it reads `enable_thinking` (Qwen3, SmolLM3, GLM, DeepSeek R1 as llama.cpp ships it, ...) or
  `thinking` (DeepSeek V3.1+, Granite 3.3, Kimi K3): on for every level but `none`;
- it reads `thinking_effort` (Kimi K3): the nearest level it names; `thinking_budget`
  (Seed-OSS): 0 for `none`;
- none of those, but the template acts on `/think` and `/no_think` in the system message
  (Nemotron Nano 2): that flag is appended to the system message (one is added if missing);
- none of those: a prompt that opens `<think>` itself (DeepSeek R1's original template) is
  closed with `</think>` for `none`; a model that thinks (`has_think_tokens`: its vocabulary has
  `<think>` tokens and its template mentions them) otherwise gets an empty block
  (`<think>\n\n</think>\n\n`, what Qwen3 writes for thinking off) for `none`, and is left to
  think for the other levels; a model with no thinking at all (SmolLM2; Qwen3-Coder, whose
  vocabulary has the tokens but whose template never writes them) honours `none` as it is and
  refuses the other levels (400 naming `reasoning_effort`).
- `chat_template_kwargs.enable_thinking`, when given, wins: it decides on / off, and the level
  stays the request's (or `medium`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flotilla.libs.common.errors import invalid_request

LEVELS = ("none", "minimal", "low", "medium", "high")
_SCALE = {"minimal": 0, "low": 1, "medium": 2, "high": 3, "max": 4}
EMPTY_BLOCK = "<think>\n\n</think>\n\n"


@dataclass
class ThinkingPlan:
    """What the prompt gets for a request's reasoning effort."""

    kwargs: dict[str, Any] = field(default_factory=dict)  # template variables
    system_flag: str | None = None  # "/think" or "/no_think", appended to the system message
    # for `none` when no template switch exists: close the block the prompt opens, or write an
    # empty one
    close_open_block: bool = False
    empty_block: bool = False


def _named(source: str, word: str) -> bool:
    return f'"{word}"' in source or f"'{word}'" in source


def _levels(source: str) -> list[str]:
    """The levels a template names, when it names several (then it checks the value); a
    template naming one or none writes whatever it gets."""
    named = [name for name in _SCALE if _named(source, name)]
    return named if len(named) > 1 else []


def _nearest(level: str, source: str) -> str:
    """`level`, or the level the template names that is closest to it (ties: the higher)."""
    named = _levels(source)
    if not named:  # "minimal" is newer than most templates: the level below it they know
        return "low" if level == "minimal" and not _named(source, "minimal") else level
    if level in named:
        return level
    return min(named, key=lambda n: (abs(_SCALE[n] - _SCALE[level]), -_SCALE[n]))


def plan_thinking(effort: str | None, enable_thinking: bool | None, variables: frozenset[str],
                  source: str, has_think_tokens: bool) -> ThinkingPlan:
    """The plan for `effort` (None: leave the template alone) under a template reading
    `variables`, whose text is `source` (see module rules)."""
    if enable_thinking is not None:
        effort = (effort if effort not in (None, "none") else "medium") if enable_thinking else (
            "none")
    if effort is None:
        return ThinkingPlan()
    on = effort != "none"
    out = ThinkingPlan()
    switch = bool({"enable_thinking", "thinking"} & variables)
    if "reasoning_effort" in variables:
        if on:
            out.kwargs["reasoning_effort"] = _nearest(effort, source)
        elif _named(source, "no_think"):
            out.kwargs["reasoning_effort"] = "no_think"
        elif _named(source, "none") or switch:
            out.kwargs["reasoning_effort"] = "none"
        elif _levels(source):  # its lowest level (Solar Open writes no reasoning for it)
            out.kwargs["reasoning_effort"] = _levels(source)[0]
        else:
            raise invalid_request("reasoning_effort: this model's chat template cannot turn "
                                  "reasoning off; use minimal, low, medium or high",
                                  param="reasoning_effort", code="invalid_value")
    for name in ("enable_thinking", "thinking"):
        if name in variables:
            out.kwargs[name] = on
    if "thinking_effort" in variables and on:
        out.kwargs["thinking_effort"] = _nearest(effort, source)
    if "thinking_budget" in variables and not on:
        out.kwargs["thinking_budget"] = 0
    if out.kwargs:
        return out
    if _named(source, "/think") and _named(source, "/no_think"):
        out.system_flag = "/think" if on else "/no_think"
        return out
    if not on:
        out.close_open_block = True
        out.empty_block = has_think_tokens
    elif not has_think_tokens:
        raise invalid_request("reasoning_effort: this model has no thinking mode; only `none` "
                              "applies to it", param="reasoning_effort", code="invalid_value")
    return out


def with_system_flag(messages: list[dict[str, Any]], flag: str) -> list[dict[str, Any]]:
    """`messages` with `flag` appended to the system message's text (one is added if none)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": f" {flag}"}]
        else:
            content = f"{content or ''} {flag}".lstrip()
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": flag}, *messages]
