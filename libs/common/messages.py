"""Typed messages for every NATS subject (see subjects.py for who sends what where).

Transport code encodes and decodes these with `encode` / `decode`; nothing on the bus is an
untyped dict except OpenAI-shaped payloads we pass through verbatim (chat messages, tool schemas).
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from flotilla.libs.common.model_capabilities import Capability
from flotilla.libs.common.subjects import PROTOCOL_VERSION


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: str = PROTOCOL_VERSION


M = TypeVar("M", bound=BaseModel)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=False).encode()


def decode(data: bytes, cls: type[M]) -> M:
    return cls.model_validate_json(data)


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    """An error in OpenAI's envelope terms, with the HTTP status the gateway should answer."""

    status: int = 500
    type: str = "server_error"
    message: str
    param: str | None = None
    code: str | None = None
    # overload (429/503): when the client may try again; the gateway sends it as `Retry-After`
    retry_after_s: float | None = None


# ---------------------------------------------------------------- sampling


class GuidedDecoding(BaseModel):
    """A constraint on what the engine may generate, compiled by xgrammar in the engine.

    `value` is JSON text for json_schema (a JSON Schema) and structural_tag (xgrammar's
    structural tag: tool calls, reasoning before JSON), EBNF for grammar, a regular expression
    for regex, unused for json_object.
    `special_tokens`: texts of control tokens the grammar writes (e.g. `[TOOL_CALLS]`); every
    other special token is never allowed under a constraint. The tokenizer service validates the
    spec before admission (400 on a bad one); an engine that still fails to compile it ends the
    request instead of crashing.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["json_schema", "json_object", "structural_tag", "grammar", "regex"]
    value: str | None = None
    special_tokens: list[str] = Field(default_factory=list)


class SamplingOptions(BaseModel):
    """What the engine needs to pick tokens. temperature 0 = greedy.

    `logit_bias`: token id → value added to its logit before sampling (OpenAI's ±100 bans or
    forces). `min_tokens`: EOS and `stop_token_ids` are held back until this many tokens were
    generated. `prompt_logprobs`: None = off; k >= 0 = the logprob of every prompt token after
    the first, with the k most likely alternatives (vLLM's `prompt_logprobs`, and what
    `/v1/completions` `echo` + `logprobs` reports).
    """

    model_config = ConfigDict(extra="forbid")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    guided: GuidedDecoding | None = None
    logit_bias: dict[int, float] = Field(default_factory=dict)
    min_tokens: int = 0
    prompt_logprobs: int | None = None


# ---------------------------------------------------------------- gateway → tokenizer


class TextRequest(Message):
    """One choice of one OpenAI request, already validated by the gateway.

    `response_format` is the one internal spelling of every structured-output form clients send
    (OpenAI `response_format`, vLLM `structured_outputs` / `guided_*`, llama.cpp `grammar` /
    `json_schema`), normalised by the gateway to one of:
    `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"schema": {...}, ...}}`,
    `{"type": "regex", "regex": str}`, `{"type": "choice", "choice": [str, ...]}`,
    `{"type": "grammar", "grammar": str}` (GBNF / xgrammar EBNF) and
    `{"type": "structural_tag", "structural_tag": {...}}`.
    `priority`: lower is served first (vLLM's convention), FCFS within a level. `deadline`:
    Unix time (seconds) after which every hop aborts the request with a terminal error.
    `reasoning_effort`: none | minimal | low | medium | high (none = thinking off).
    """

    request_id: str
    model: str
    kind: Literal["chat", "completion"]
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    stop: list[str] = Field(default_factory=list)
    response_format: dict[str, Any] | None = None
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    stream_subject: str
    priority: int = 0
    deadline: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    continue_final_message: bool = False
    suffix: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class Admission(Message):
    """Reply to a generate request: accepted (the stream follows) or refused with an error."""

    request_id: str
    accepted: bool
    instance: str = ""
    prompt_tokens: int = 0
    error: ErrorInfo | None = None


class EncodeRequest(Message):
    """Plain tokenization of a text (/tokenize of a prompt, or of a rendered chat with
    `add_special_tokens`): no template, no context check. `token_strs`: also each id's
    vocabulary string (vLLM's `return_token_strs`)."""

    model: str
    text: str
    add_special_tokens: bool = True
    token_strs: bool = False


class EncodeReply(Message):
    token_ids: list[int] = Field(default_factory=list)
    token_strs: list[str] | None = None
    max_model_len: int = 0
    error: ErrorInfo | None = None


class DecodeRequest(Message):
    """Token ids → text (/detokenize), special tokens kept as vLLM's /detokenize does; an id
    outside the vocabulary is a 400 naming `tokens`."""

    model: str
    token_ids: list[int]


class DecodeReply(Message):
    text: str = ""
    error: ErrorInfo | None = None


class RenderReply(Message):
    """The rendered prompt of a TextRequest (chat template applied, tools injected)."""

    prompt: str = ""
    token_ids: list[int] = Field(default_factory=list)
    max_model_len: int = 0
    error: ErrorInfo | None = None


# ---------------------------------------------------------------- tokenizer → engine


class TokenRequest(Message):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stream_subject: str
    priority: int = 0  # lower first, FCFS within a level
    deadline: float | None = None  # Unix time; past it the engine aborts with an error frame


# ---------------------------------------------------------------- stream frames

D = TypeVar("D", bound=BaseModel)
F = TypeVar("F", bound=BaseModel)


class StreamFrame(BaseModel, Generic[D, F]):
    """One frame of a per-request stream. `seq` counts every frame (heartbeats too) from 0, so a
    receiver notices a lost frame. A stream ends with exactly one `final` or `error` frame."""

    request_id: str
    seq: int
    kind: Literal["data", "final", "error", "heartbeat"]
    data: D | None = None
    final: F | None = None
    error: ErrorInfo | None = None


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class TokenDelta(BaseModel):
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    # first delta only, with `sampling.prompt_logprobs`: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TokenFinal(BaseModel):
    finish_reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_token_id: int | None = None


class ToolCallDelta(BaseModel):
    """OpenAI's streamed tool call piece: id/name come first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TextLogprob(BaseModel):
    """One token's logprob as text. `token_id` / `top_ids` (the ids of `token` and of `top`'s
    entries, in order) let the gateway answer vLLM's `prompt_logprobs`, which is keyed by id."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[tuple[str, float]] = Field(default_factory=list)
    token_id: int | None = None
    top_ids: list[int] = Field(default_factory=list)


class TextDelta(BaseModel):
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = Field(default_factory=list)
    logprobs: list[TextLogprob] | None = None
    prompt_logprobs: list[TextLogprob | None] | None = None  # as TokenDelta's, detokenized
    # with prompt_logprobs: the first prompt token's text (its entry is None: nothing precedes
    # it), which OpenAI's legacy echo + logprobs lists first
    prompt_first_token: str = ""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TextFinal(BaseModel):
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]
    usage: Usage
    stop_string: str | None = None  # the request's stop string that ended the text, if one did


TokenFrame = StreamFrame[TokenDelta, TokenFinal]
TextFrame = StreamFrame[TextDelta, TextFinal]


# ---------------------------------------------------------------- control


class Cancel(Message):
    request_id: str
    reason: Literal["client_disconnect", "stop_string", "deadline", "shutdown"]


class Announcement(Message):
    """Periodic 'I am here' from a service; engines add their load for routing.

    Engines also say how full their bounded queue is: `waiting` requests / `waiting_tokens`
    prompt tokens against `max_waiting_requests` / `max_waiting_tokens` (past either the engine
    refuses with 503 `engine_overloaded`), and `tokens_per_s`, their recent rate (a queue's
    expected drain time is waiting_tokens / tokens_per_s).
    """

    service: Literal["gateway", "tokenizer", "engine", "tools"]
    instance: str
    model: str | None = None
    max_model_len: int | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    waiting_tokens: int = 0
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    tokens_per_s: float = 0.0
    # engines: what their model serves (model_capabilities.py); None where not known
    capabilities: list[Capability] | None = None


class Ping(Message):
    pass


class HealthRequest(Message):
    pass


class HealthReply(Message):
    service: str
    instance: str
    ok: bool
    detail: dict[str, Any] = Field(default_factory=dict)
    # seconds since the service's work loop last went round (engine: its step loop, which beats
    # every step and every idle wait); None = no such loop. /ready calls a stale one wedged.
    heartbeat_age_s: float | None = None


class StatsRequest(Message):
    pass


class EngineStats(Message):
    engine_id: str
    model: str
    running: int
    waiting: int
    requests_finished: int
    requests_aborted: int
    tokens_generated: int
    prompt_tokens: int
    cached_prompt_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    waiting_tokens: int = 0  # queue state as in Announcement
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    tokens_per_s: float = 0.0
    requests_failed: int = 0  # finished with an error of their own (the engine went on)
    active_request_ids: list[str] = Field(default_factory=list)
    aborted_request_ids: list[str] = Field(default_factory=list)
