"""A validated OpenAI request body → the TextRequests that serve it, one per choice.

Rules:
- Choice `i` (of `n`, and of each prompt of a list-prompt completion: index = prompt * n + j)
  becomes one TextRequest with request_id `f"{rid}-{i}"` and, when seeded, seed
  `(seed + i) mod 2^63`: clients may send any int64 seed (OpenAI does), the engine takes
  [0, 2^63).
- `stream_options` without `stream: true` is ignored, as OpenAI does.
- Only values the schema already accepted arrive here; this module checks what a static schema
  cannot (the server's `max_n`, option combinations) and maps every name clients use onto
  TextRequest / SamplingOptions (docs/api_compatibility.md lists each field's fate):
  OpenAI's, vLLM's (`min_tokens`, `stop_token_ids`, `prompt_logprobs`, `priority`, ...) and
  llama.cpp's (`n_predict` = `max_tokens`, -1 = as many as fit). `logit_bias` keys are token ids
  as strings (OpenAI's JSON); `max_completion_tokens` wins over its deprecated `max_tokens`.
- Chat messages reach the tokenizer normalised (history.py); legacy `functions` arrive as tools
  (functions.py); every structured-output spelling arrives as the one internal
  `response_format` (structured.py).
- Prompt logprobs: vLLM's `prompt_logprobs: k`, and on /v1/completions `echo` with
  `logprobs: k` (OpenAI's legacy API puts the prompt's tokens first in `logprobs`); the engine
  is asked for the larger k.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from flotilla.libs.common import subjects
from flotilla.libs.common.errors import invalid_request
from flotilla.libs.common.messages import SamplingOptions, TextRequest
from flotilla.services.gateway.functions import allowed_tools
from flotilla.services.gateway.history import normalize_messages
from flotilla.services.gateway.structured import structured_output

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
SEED_MODULUS = 2**63  # the engine's seeds are in [0, 2^63)
ReasoningField = Literal["reasoning_content", "reasoning", "both"]
# OpenAI's efforts above `high` ask for the most this server has: `high`'s budget.
_EFFORT = {"xhigh": "high", "max": "high"}


@dataclass
class Plan:
    """What one HTTP request asks for: the per-choice requests and how to answer.

    `echo_logprobs`: a completion's `logprobs` start with its prompt's tokens (echo + logprobs);
    `prompt_logprobs`: the response carries vLLM's `prompt_logprobs`; `legacy_functions`: the
    request sent `functions`, so a call is answered as `function_call` (functions.py)."""

    kind: Literal["chat", "completion"]
    rid: str
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    requests: list[TextRequest]
    prompt_of: list[int]  # choice index → index of its prompt (usage counts each prompt once)
    reasoning_field: ReasoningField = "reasoning_content"
    echo_logprobs: bool = False
    prompt_logprobs: bool = False
    legacy_functions: bool = False

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


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int | None) -> int | None:
    """The first of `names` that is set; llama.cpp's `n_predict` (-1: as many as fit) only when
    none is, and a 400 naming it beside one of them."""
    n_predict = body.get("n_predict")
    for name in names:
        if body.get(name) is not None:
            if n_predict is not None:
                raise invalid_request(f"`n_predict` and `{name}` both bound the completion; "
                                      "send one of them.", param="n_predict")
            return int(body[name])
    if n_predict is not None:
        return None if n_predict == -1 else int(n_predict)
    return default


def sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
             prompt_logprobs: int | None = None) -> SamplingOptions:
    min_tokens = int(_get(body, "min_tokens", 0))
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid_request(f"`min_tokens` ({min_tokens}) cannot be above the completion's "
                              f"maximum of {max_tokens} tokens.", param="min_tokens")
    return SamplingOptions(
        temperature=float(_get(body, "temperature", 1.0)),
        top_p=float(_get(body, "top_p", 1.0)),
        top_k=max(int(_get(body, "top_k", 0)), 0),
        min_p=float(_get(body, "min_p", 0.0)),
        seed=body.get("seed"),
        max_tokens=max_tokens,
        presence_penalty=float(_get(body, "presence_penalty", 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", 0.0)),
        repetition_penalty=float(_get(body, "repetition_penalty", 1.0)),
        stop_token_ids=list(_get(body, "stop_token_ids", [])),
        ignore_eos=bool(_get(body, "ignore_eos", False)),
        logprobs=logprobs,
        logit_bias={int(k): float(v) for k, v in _get(body, "logit_bias", {}).items()},
        min_tokens=min_tokens,
        prompt_logprobs=prompt_logprobs,
    )


def _seeded(base: SamplingOptions, i: int) -> SamplingOptions:
    if base.seed is None:
        return base
    return base.model_copy(update={"seed": (base.seed + i) % SEED_MODULUS})


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """TextRequest fields both kinds take from the body."""
    return {"stop": _stop(body), "response_format": structured_output(body),
            "priority": int(_get(body, "priority", 0)),
            "skip_special_tokens": bool(_get(body, "skip_special_tokens", True)),
            "include_stop_str_in_output": bool(_get(body, "include_stop_str_in_output", False))}


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


def generation_prompt(body: dict[str, Any]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM reads them: continuing the final
    message opens no new turn unless `add_generation_prompt: true` says so, which is a 400."""
    cont = bool(_get(body, "continue_final_message", False))
    add = body.get("add_generation_prompt")
    if cont and add:
        raise invalid_request("`continue_final_message` and `add_generation_prompt` cannot both "
                              "be true: the reply either continues the last message or opens "
                              "a new assistant turn.", param="continue_final_message")
    return (not cont) if add is None else bool(add), cont


def reasoning_effort(body: dict[str, Any]) -> Any:
    effort = body.get("reasoning_effort")
    return effort if effort is None else _EFFORT.get(effort, effort)


def chat_plan(body: dict[str, Any], tools: list[dict[str, Any]] | None, max_n: int,
              rid: str | None = None,
              reasoning_field: ReasoningField = "reasoning_content") -> Plan:
    """`body` with legacy `functions` already mapped (functions.from_legacy); `tools` are the
    request's own or the MCP ones."""
    rid = rid or new_request_id()
    n = _check_n(body, max_n)
    tools, tool_choice = allowed_tools(tools, body.get("tool_choice"))
    _check_tool_choice(tool_choice, tools)
    want_logprobs = bool(_get(body, "logprobs", False))
    top = body.get("top_logprobs")
    if top is not None and not want_logprobs:
        raise invalid_request("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    prompt_logprobs = body.get("prompt_logprobs")
    base = sampling(body, max_tokens, int(top or 0) if want_logprobs else None, prompt_logprobs)
    add_generation_prompt, continue_final = generation_prompt(body)
    messages = normalize_messages(body["messages"])
    options = _options(body)
    requests = []
    for i in range(n):
        request_id = f"{rid}-{i}"
        requests.append(TextRequest(
            request_id=request_id, model=body["model"], kind="chat", messages=messages,
            tools=tools, tool_choice=tool_choice if tools else None,
            parallel_tool_calls=bool(_get(body, "parallel_tool_calls", True)),
            chat_template_kwargs=body.get("chat_template_kwargs"),
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
            echo=bool(_get(body, "echo", False)), reasoning_effort=reasoning_effort(body),
            sampling=_seeded(base, i), stream_subject=subjects.text_stream(request_id),
            **options))
    return Plan("chat", rid, body["model"], bool(_get(body, "stream", False)),
                _include_usage(body), want_logprobs, requests, [0] * n, reasoning_field,
                prompt_logprobs=prompt_logprobs is not None,
                legacy_functions=body.get("functions") is not None)


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
    echo = bool(_get(body, "echo", False))
    echo_logprobs = echo and logprobs is not None
    asked = [k for k in (body.get("prompt_logprobs"), logprobs if echo_logprobs else None)
             if k is not None]
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    base = sampling(body, max_tokens, logprobs, max(asked) if asked else None)
    options = _options(body)
    requests, prompt_of = [], []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            i = p * n + j
            request_id = f"{rid}-{i}"
            requests.append(TextRequest(
                request_id=request_id, model=body["model"], kind="completion", prompt=prompt,
                echo=echo, suffix=body.get("suffix"), sampling=_seeded(base, i),
                stream_subject=subjects.text_stream(request_id), **options))
            prompt_of.append(p)
    return Plan("completion", rid, body["model"], bool(_get(body, "stream", False)),
                _include_usage(body), logprobs is not None, requests, prompt_of,
                echo_logprobs=echo_logprobs,
                prompt_logprobs=body.get("prompt_logprobs") is not None)


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None or not body.get("stream"):
        return False
    return bool(options.get("include_usage"))
