"""Text deltas of every choice → OpenAI's non-streaming objects (chat.completion, text_completion),
plus the pieces streaming chunks share with them (usage, finish reasons, logprobs).

Rules:
- Usage counts each prompt once (n choices of one prompt share it; a list prompt counts each of
  its prompts), and every choice's completion tokens.
- `abort` (an engine dropped the request, e.g. at shutdown) is reported as `stop`: OpenAI has no
  finish reason for it. Completions cannot call tools, so `tool_calls` is `stop` there too.
- A request that sent legacy `functions` gets its call as `function_call` (functions.py).
- Prompt logprobs (logprobs.py): a completion's echoed prompt tokens lead its `logprobs`; vLLM's
  `prompt_logprobs` is per choice on completions and once per response on chat (all choices
  share the prompt), as vLLM answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flotilla.libs.common.messages import TextDelta, TextFinal, TextLogprob, ToolCallDelta
from flotilla.libs.common.subjects import PROTOCOL_VERSION
from flotilla.services.gateway.functions import function_call
from flotilla.services.gateway.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from flotilla.services.gateway.plan import Plan
from flotilla.services.gateway.streams import ChoiceStreams

SYSTEM_FINGERPRINT = f"fp_flotilla_{PROTOCOL_VERSION}"
_CHAT_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}
_COMPLETION_FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "stop"}


def chat_finish(final: TextFinal, legacy_functions: bool = False) -> str:
    reason = _CHAT_FINISH[final.finish_reason]
    return "function_call" if legacy_functions and reason == "tool_calls" else reason


def completion_finish(final: TextFinal) -> str:
    return _COMPLETION_FINISH[final.finish_reason]


def usage_dict(plan: Plan, finals: dict[int, TextFinal]) -> dict[str, Any]:
    prompt = cached = completion = 0
    counted: set[int] = set()
    for index, final in sorted(finals.items()):
        completion += final.usage.completion_tokens
        if plan.prompt_of[index] not in counted:
            counted.add(plan.prompt_of[index])
            prompt += final.usage.prompt_tokens
            cached += final.usage.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call_chunk(call: ToolCallDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index}
    if call.id is not None:
        out["id"] = call.id
        out["type"] = "function"
    function: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        function["name"] = call.name
    out["function"] = function
    return out


@dataclass
class ChoiceResult:
    """Everything one choice produced, accumulated from its deltas."""

    text: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)
    logprobs: list[TextLogprob] = field(default_factory=list)
    logprobs_offset: int = 0  # characters of text before the first token with logprobs (echo)
    prompt_logprobs: list[TextLogprob | None] | None = None
    prompt_first_token: str = ""
    final: TextFinal | None = None

    def add(self, delta: TextDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_first_token = delta.prompt_first_token
        if delta.logprobs and not self.logprobs:
            self.logprobs_offset = len(self.text)
        self.text += delta.text
        self.reasoning += delta.reasoning
        for call in delta.tool_calls:
            slot = self.tool_calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] = call.id or slot["id"]
            slot["name"] = call.name or slot["name"]
            slot["arguments"] += call.arguments
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)


async def collect(streams: ChoiceStreams) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in streams.requests]
    async for index, frame in streams.events():
        if frame.kind == "data" and frame.data is not None:
            results[index].add(frame.data)
        elif frame.kind == "final":
            results[index].final = frame.final
    return results


def _finals(results: list[ChoiceResult]) -> dict[int, TextFinal]:
    return {i: r.final for i, r in enumerate(results) if r.final is not None}


def chat_completion(plan: Plan, results: list[ChoiceResult], created: int) -> dict[str, Any]:
    choices = []
    for index, r in enumerate(results):
        assert r.final is not None
        calls = [{"id": c["id"] or f"call_{plan.rid}_{index}_{k}", "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for k, c in sorted(r.tool_calls.items())]
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if calls and not r.text else r.text,
                                   "refusal": None}
        message.update(plan.reasoning(r.reasoning))
        if calls and plan.legacy_functions:
            message["function_call"] = function_call(calls)
        elif calls:
            message["tool_calls"] = calls
        choices.append({"index": index, "message": message,
                        "logprobs": chat_logprobs(r.logprobs) if plan.logprobs else None,
                        "finish_reason": chat_finish(r.final, plan.legacy_functions)})
    out = {"id": plan.response_id, "object": "chat.completion", "created": created,
           "model": plan.model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
           "usage": usage_dict(plan, _finals(results))}
    if plan.prompt_logprobs:
        out["prompt_logprobs"] = vllm_prompt_logprobs(results[0].prompt_logprobs or [])
    return out


def _completion_logprobs(plan: Plan, r: ChoiceResult) -> dict[str, Any] | None:
    if not plan.logprobs:
        return None
    generated = completion_logprobs(r.logprobs, r.logprobs_offset)
    if plan.echo_logprobs and r.prompt_logprobs is not None:
        return echo_logprobs(r.prompt_logprobs, r.prompt_first_token, generated)
    return generated


def text_completion(plan: Plan, results: list[ChoiceResult], created: int) -> dict[str, Any]:
    choices = []
    for index, r in enumerate(results):
        assert r.final is not None
        choice = {"index": index, "text": r.text, "logprobs": _completion_logprobs(plan, r),
                  "finish_reason": completion_finish(r.final)}
        if plan.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs or [])
        choices.append(choice)
    return {"id": plan.response_id, "object": "text_completion", "created": created,
            "model": plan.model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
            "usage": usage_dict(plan, _finals(results))}
