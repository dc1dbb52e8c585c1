"""A validated OpenAI request body → the TextRequests that serve it, one per choice.

Rules:
- Choice `i` (of `n`, and of each prompt of a list-prompt completion: index = prompt * n + j)
  becomes one TextRequest with request_id `f"{rid}-{i}"` and, when seeded, seed
  `(seed + i) mod 2^63`: clients may send any int64 seed (OpenAI does), the engine takes
  [0, 2^63).
- `stream_options` without `stream: true` is ignored, as OpenAI does.
- Only values the schema already accepted arrive here; this module checks what a static schema
  cannot (the server's `max_n`, option combinations) and maps OpenAI names onto SamplingOptions.
- Chat messages reach the tokenizer normalised: text-part arrays joined into one string, and the
  response-only fields a client may echo back (`refusal`, `annotations`, null `audio` /
  `function_call` / `tool_calls` / reasoning) dropped; reasoning sent back as `reasoning` reaches
  templates as `reasoning_content` (the name templates read); an assistant turn with neither
  content nor tool calls (content null, as responses carry it) reads as empty text.
- `response_format` passes through to the tokenizer (which turns it into the engine's grammar and
  refuses a bad schema); `json_schema` needs its `schema` (checked here).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from libs.common import subjects
from libs.common.errors import invalid_request
from libs.common.messages import SamplingOptions, TextRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
SEED_MODULUS = 2**63  # the engine's seeds are in [0, 2^63)
_ECHOED_FIELDS = ("refusal", "annotations", "audio", "function_call")
ReasoningField = Literal["reasoning_content", "reasoning", "both"]


@dataclass
class Plan:
    """What one HTTP request asks for: the per-choice requests and how to answer."""

    kind: Literal["chat", "completion"]
    rid: str
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    requests: list[TextRequest]
    prompt_of: list[int]  # choice index → index of its prompt (usage counts each prompt once)
    reasoning_field: ReasoningField = "reasoning_content"

    def reasoning(self, text: str) -> dict[str, str]:
        """The reasoning text under the configured name(s); {} when there is none."""
        if not text:
            return {}
        if self.reasoning_field == "both":
            return {"reasoning_content": text, "reasoning": text}
        return {self.reasoning_field: text}

    @property
    def response_id(self) -> str:
        return f"chatcmpl-{self.rid}" if self.kind == "chat" else f"cmpl-{self.rid}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def _get(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _check_n(body: dict[str, Any], max_n: int) -> int:
    n = int(_get(body, "n", 1))
    if n > max_n:
        raise invalid_request(f"Invalid value for `n`: {n} is above this server's maximum of "
                              f"{max_n}.", param="n")
    return n


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
    top_k = int(_get(body, "top_k", 0))
    return SamplingOptions(
        temperature=float(_get(body, "temperature", 1.0)),
        top_p=float(_get(body, "top_p", 1.0)),
        top_k=max(top_k, 0),
        min_p=float(_get(body, "min_p", 0.0)),
        seed=body.get("seed"),
        max_tokens=max_tokens,
        presence_penalty=float(_get(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", 0.0)),
        repetition_penalty=float(_get(body, "repetition_penalty", 1.0)),
        ignore_eos=bool(_get(body, "ignore_eos", False)),
        logprobs=logprobs,
    )


def _seeded(base: SamplingOptions, i: int) -> SamplingOptions:
    if base.seed is None:
        return base
    return base.model_copy(update={"seed": (base.seed + i) % SEED_MODULUS})


def normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k not in _ECHOED_FIELDS}
    if out.get("tool_calls") is None:
        out.pop("tool_calls", None)
    reasoning = out.pop("reasoning", None)
    if out.get("reasoning_content") is None:
        out.pop("reasoning_content", None)
        if isinstance(reasoning, str):
            out["reasoning_content"] = reasoning
    content = out.get("content")
    if out.get("role") == "assistant" and content is None and not out.get("tool_calls"):
        out["content"] = ""
        out.pop("tool_calls", None)
    if isinstance(content, list):
        out["content"] = "\n".join(part["text"] for part in content)
    return out


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """`required` or a named function needs tools (the request's own or the MCP ones)."""
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise invalid_request("`tool_choice` requires tools, but the request has none (and no "
                              "MCP tools are available).", param="tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid_request(f"`tool_choice` names the function `{name}`, which is not "
                                  "among the tools.", param="tool_choice.function.name")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("response_format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_schema" and not isinstance(
            (fmt.get("json_schema") or {}).get("schema"), dict):
        raise invalid_request("`response_format.json_schema.schema` is required for type "
                              "json_schema.", param="response_format.json_schema.schema")
    return dict(fmt)


def chat_plan(body: dict[str, Any], tools: list[dict[str, Any]] | None, max_n: int,
              rid: str | None = None,
              reasoning_field: ReasoningField = "reasoning_content") -> Plan:
    rid = rid or new_request_id()
    n = _check_n(body, max_n)
    _check_tool_choice(body.get("tool_choice"), tools)
    response_format = _response_format(body)
    want_logprobs = bool(_get(body, "logprobs", False))
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise invalid_request("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    base = sampling(body, max_tokens, int(top or 0) if want_logprobs else None)
    messages = [normalize_message(m) for m in body["messages"]]
    requests = []
    for i in range(n):
        request_id = f"{rid}-{i}"
        requests.append(TextRequest(
            request_id=request_id, model=body["model"], kind="chat", messages=messages,
            tools=tools, tool_choice=body.get("tool_choice") if tools else None,
            parallel_tool_calls=bool(_get(body, "parallel_tool_calls", True)),
            chat_template_kwargs=body.get("chat_template_kwargs"), stop=_stop(body),
            response_format=response_format,
            sampling=_seeded(base, i), stream_subject=subjects.text_stream(request_id)))
    return Plan("chat", rid, body["model"], bool(_get(body, "stream", False)),
                _include_usage(body), want_logprobs, requests, [0] * n, reasoning_field)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def completion_plan(body: dict[str, Any], max_n: int, rid: str | None = None) -> Plan:
    rid = rid or new_request_id()
    n = _check_n(body, max_n)
    prompts = _prompts(body["prompt"])
    logprobs = body.get("logprobs")
    base = sampling(body, _get(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS), logprobs)
    response_format = _response_format(body)
    requests, prompt_of = [], []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            i = p * n + j
            request_id = f"{rid}-{i}"
            requests.append(TextRequest(
                request_id=request_id, model=body["model"], kind="completion", prompt=prompt,
                echo=bool(_get(body, "echo", False)), stop=_stop(body),
                response_format=response_format, sampling=_seeded(base, i),
                stream_subject=subjects.text_stream(request_id)))
            prompt_of.append(p)
    return Plan("completion", rid, body["model"], bool(_get(body, "stream", False)),
                _include_usage(body), logprobs is not None, requests, prompt_of)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None or not body.get("stream"):
        return False
    return bool(options.get("include_usage"))
