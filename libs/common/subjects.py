"""Every NATS subject flotilla uses, with the protocol version, in one place.

Request/reply subjects are served by queue groups (one replica answers); broadcast subjects
(cancel, discovery) reach every subscriber. Per-request streams get their own subject.
"""

from __future__ import annotations

import re

PROTOCOL_VERSION = "v1"
PREFIX = f"flotilla.{PROTOCOL_VERSION}"

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


def token(name: str) -> str:
    """A model name as one subject token (NATS tokens may not hold '.', '*', '>' or spaces)."""
    return _UNSAFE.sub("_", name)


def tokenizer_generate(model: str) -> str:
    """gateway → tokenizer: TextRequest; reply: Admission. Queue group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.generate"


def tokenizer_render(model: str) -> str:
    """gateway → tokenizer: TextRequest; reply: RenderReply (the prompt as the engine would see
    it, for /tokenize and debugging). Queue group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.render"


def tokenizer_encode(model: str) -> str:
    """gateway → tokenizer: EncodeRequest; reply: EncodeReply. Queue group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.encode"


def tokenizer_decode(model: str) -> str:
    """gateway → tokenizer: DecodeRequest; reply: DecodeReply. Queue group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.decode"


def tokenizer_embed(model: str) -> str:
    """gateway → tokenizer: EmbedRequest; reply: PoolReply (embeddings, score, rerank). Queue
    group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.embed"


def tokenizer_score(model: str) -> str:
    """gateway → tokenizer: ScoreRequest; reply: ScoreReply (/v1/score, /v1/rerank). Queue
    group `tokenizer`."""
    return f"{PREFIX}.tokenizer.{token(model)}.score"


def engine_pool(model: str) -> str:
    """tokenizer → engine: PoolRequest; reply: PoolReply (prefill-only pooling). Queue group
    `engine`."""
    return f"{PREFIX}.engine.{token(model)}.pool"


def engine_generate(model: str) -> str:
    """tokenizer → engine: TokenRequest; reply: Admission. Queue group `engine`."""
    return f"{PREFIX}.engine.{token(model)}.generate"


def engine_stats(engine_id: str) -> str:
    """anyone → one engine: StatsRequest; reply: EngineStats."""
    return f"{PREFIX}.engine.stats.{token(engine_id)}"


def text_stream(request_id: str) -> str:
    """tokenizer → gateway: StreamFrame[TextDelta, TextFinal] for one request."""
    return f"{PREFIX}.stream.text.{token(request_id)}"


def token_stream(request_id: str) -> str:
    """engine → tokenizer: StreamFrame[TokenDelta, TokenFinal] for one request."""
    return f"{PREFIX}.stream.tokens.{token(request_id)}"


CANCEL = f"{PREFIX}.cancel"
"""Broadcast Cancel: every tokenizer and engine drops the named request."""

DISCOVERY_ANNOUNCE = f"{PREFIX}.discovery.announce"
"""Broadcast Announcement: services say who they are and how loaded they are, periodically."""

DISCOVERY_PING = f"{PREFIX}.discovery.ping"
"""Broadcast Ping: ask every service to announce now (a gateway does this at start)."""

TOOLS_LIST = f"{PREFIX}.tools.list"
"""gateway → tools: ToolsListRequest; reply: ToolsListReply. Queue group `tools`."""

TOOLS_CALL = f"{PREFIX}.tools.call"
"""anyone → tools: ToolCallRequest; reply: ToolCallReply. Queue group `tools`."""


def health(service: str) -> str:
    """anyone → a service kind: HealthRequest; reply: HealthReply (from any one instance)."""
    return f"{PREFIX}.health.{token(service)}"


def instance_health(service: str, instance: str) -> str:
    """anyone → one instance (as named in its announcements): HealthRequest; reply:
    HealthReply. No responder = that instance is gone."""
    return f"{PREFIX}.health.{token(service)}.{token(instance)}"
