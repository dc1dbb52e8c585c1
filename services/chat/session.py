"""A terminal chat's conversation with the gateway: the history, the request options, and one
streamed answer at a time through the official openai SDK.

Rules:
- The history holds what was said: each question, and each answer as far as it got (a stopped
  answer is kept, so the next question follows on from it); reasoning is shown, not sent back.
- Only options the user set are sent; the gateway's defaults stand for the rest.
- `ask()` never raises for the server's or the network's failures, nor for Ctrl-C while the answer
  streams: they end up in the returned Answer (`error`, `stopped`). Closing the stream closes
  the HTTP connection, which makes the gateway cancel the generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import openai
from openai import Stream
from openai.types.chat import ChatCompletionChunk


class AnswerView(Protocol):
    """Where an answer is shown while it streams (services/chat/render.py)."""

    def reasoning(self, text: str) -> None: ...
    def content(self, text: str) -> None: ...
    def close(self, answer: Answer) -> None: ...


@dataclass
class ChatOptions:
    model: str
    system: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    reasoning_effort: str | None = None
    thinking: bool | None = None  # chat_template_kwargs.enable_thinking; None = model default


@dataclass
class ToolCall:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    decode_s: float | None = None  # from the first token to the end
    stopped: bool = False
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        n = self.completion_tokens
        if n is None or n < 2 or not self.decode_s:
            return None
        return (n - 1) / self.decode_s


def describe_error(exc: openai.OpenAIError) -> str:
    """An OpenAI error envelope as one plain line: "400 invalid_request_error (param x): ..."."""
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot reach the gateway: {exc}"
    body = getattr(exc, "body", None)
    status = getattr(exc, "status_code", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        head = " ".join(str(x) for x in (status, body.get("type")) if x)
        param = f" (param {body['param']})" if body.get("param") else ""
        return f"{head}{param}: {body['message']}" if head or param else body["message"]
    return str(exc)


class ChatSession:
    def __init__(self, client: openai.OpenAI, options: ChatOptions):
        self.client, self.options = client, options
        self.history: list[dict[str, Any]] = []

    def new(self) -> None:
        self.history.clear()

    def messages(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return system + self.history

    def request_options(self) -> dict[str, Any]:
        o = self.options
        kwargs: dict[str, Any] = {"model": o.model, "stream": True,
                                  "stream_options": {"include_usage": True}}
        for name in ("temperature", "top_p", "max_tokens", "reasoning_effort"):
            if getattr(o, name) is not None:
                kwargs[name] = getattr(o, name)
        if o.thinking is not None:
            kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": o.thinking}}
        return kwargs

    def ask(self, text: str, view: AnswerView) -> Answer:
        self.history.append({"role": "user", "content": text})
        answer = Answer()
        start = time.perf_counter()
        first: float | None = None
        stream: Stream[ChatCompletionChunk] | None = None
        try:
            stream = cast(Stream[ChatCompletionChunk], self.client.chat.completions.create(
                messages=cast(Any, self.messages()), **self.request_options()))
            for chunk in stream:
                if chunk.usage is not None:
                    answer.prompt_tokens = chunk.usage.prompt_tokens
                    answer.completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if self._apply(answer, choice, view) and first is None:
                        first = time.perf_counter()
                    answer.finish_reason = choice.finish_reason or answer.finish_reason
        except KeyboardInterrupt:
            answer.stopped = True
        except openai.OpenAIError as exc:
            answer.error = describe_error(exc)
        finally:
            if stream is not None:
                stream.close()
        end = time.perf_counter()
        if first is not None:
            answer.ttft_s, answer.decode_s = first - start, end - first
        self._remember(answer)
        view.close(answer)
        return answer

    @staticmethod
    def _apply(answer: Answer, choice: Any, view: AnswerView) -> bool:
        delta = choice.delta
        produced = False
        extra = delta.model_extra or {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")
        if reasoning:
            answer.reasoning += reasoning
            view.reasoning(reasoning)
            produced = True
        if delta.content:
            answer.content += delta.content
            view.content(delta.content)
            produced = True
        for call in delta.tool_calls or []:
            while len(answer.tool_calls) <= call.index:
                answer.tool_calls.append(ToolCall())
            target = answer.tool_calls[call.index]
            target.id = call.id or target.id
            if call.function is not None:
                target.name += call.function.name or ""
                target.arguments += call.function.arguments or ""
            produced = True
        return produced

    def _remember(self, answer: Answer) -> None:
        if not answer.content and not answer.tool_calls:
            self.history.pop()  # nothing was answered: the question goes too (no two in a row)
            return
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in answer.tool_calls]
        self.history.append(message)
