"""Stream frames → OpenAI's streamed objects (chat.completion.chunk / text_completion chunks).

Rules:
- Chat: each choice's first chunk is `delta: {role: assistant, content: ""}` (sent as soon as
  every choice is admitted); then content / reasoning (named by the `reasoning_field` setting) /
  tool_calls deltas (a call's first delta has its index, id and name, later ones argument
  fragments); its last chunk has an empty delta and the finish_reason.
- Completions: `text` deltas with `finish_reason: null`, then a last chunk per choice with `""`
  and the finish reason (OpenAI sends null on non-final chunks although its schema omits it).
- A request that sent legacy `functions` streams its call as `delta.function_call` pieces and
  finishes with `function_call` (functions.py).
- Prompt logprobs ride on the chunk of the delta that brings them (the first): with echo +
  logprobs in a completion chunk's `logprobs` (the prompt's tokens from offset 0), and vLLM's
  `prompt_logprobs` on the completion choice, or on the chat chunk itself.
- `usage_chunk()` (for `stream_options.include_usage`) has empty `choices` and the usage of all
  choices; it is valid only after every choice's final.
"""

from __future__ import annotations

from typing import Any

from flotilla.libs.common.messages import TextDelta, TextFinal
from flotilla.services.gateway.functions import function_call_delta
from flotilla.services.gateway.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from flotilla.services.gateway.plan import Plan
from flotilla.services.gateway.results import (
    SYSTEM_FINGERPRINT,
    chat_finish,
    completion_finish,
    tool_call_chunk,
    usage_dict,
)


class ChunkBuilder:
    """Builds one request's chunks; subclasses shape the choices."""

    object_name = ""

    def __init__(self, plan: Plan, created: int):
        self.plan, self.created = plan, created
        self.finals: dict[int, TextFinal] = {}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.plan.response_id, "object": self.object_name, "created": self.created,
                "model": self.plan.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, index: int, delta: TextDelta) -> dict[str, Any] | None:
        raise NotImplementedError

    def final(self, index: int, final: TextFinal) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage_dict(self.plan, self.finals)}


class ChatChunks(ChunkBuilder):
    object_name = "chat.completion.chunk"

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.plan.requests))]

    def delta(self, index: int, delta: TextDelta) -> dict[str, Any] | None:
        body: dict[str, Any] = {}
        if delta.text:
            body["content"] = delta.text
        body.update(self.plan.reasoning(delta.reasoning))
        if delta.tool_calls and self.plan.legacy_functions:
            body["function_call"] = function_call_delta(delta.tool_calls)
        elif delta.tool_calls:
            body["tool_calls"] = [tool_call_chunk(c) for c in delta.tool_calls]
        logprobs = chat_logprobs(delta.logprobs) if self.plan.logprobs and delta.logprobs else None
        prompt = self.plan.prompt_logprobs and delta.prompt_logprobs is not None
        if not body and logprobs is None and not prompt:
            return None
        chunk = self._chunk([{"index": index, "delta": body, "logprobs": logprobs,
                              "finish_reason": None}])
        if prompt:
            chunk["prompt_logprobs"] = vllm_prompt_logprobs(delta.prompt_logprobs or [])
        return chunk

    def final(self, index: int, final: TextFinal) -> dict[str, Any]:
        self.finals[index] = final
        return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                             "finish_reason": chat_finish(final, self.plan.legacy_functions)}])


class CompletionChunks(ChunkBuilder):
    object_name = "text_completion"

    def __init__(self, plan: Plan, created: int):
        super().__init__(plan, created)
        self._offsets = [0] * len(plan.requests)

    def delta(self, index: int, delta: TextDelta) -> dict[str, Any] | None:
        prompt = delta.prompt_logprobs
        if not delta.text and not delta.logprobs and prompt is None:
            return None
        logprobs = None
        if self.plan.logprobs and delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, self._offsets[index])
        if self.plan.echo_logprobs and prompt is not None:
            logprobs = echo_logprobs(prompt, delta.prompt_first_token, logprobs)
        self._offsets[index] += len(delta.text)
        choice = {"index": index, "text": delta.text, "logprobs": logprobs,
                  "finish_reason": None}
        if self.plan.prompt_logprobs and prompt is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
        return self._chunk([choice])

    def final(self, index: int, final: TextFinal) -> dict[str, Any]:
        self.finals[index] = final
        return self._chunk([{"index": index, "text": "", "logprobs": None,
                             "finish_reason": completion_finish(final)}])


def chunk_builder(plan: Plan, created: int) -> ChunkBuilder:
    return ChatChunks(plan, created) if plan.kind == "chat" else CompletionChunks(plan, created)
