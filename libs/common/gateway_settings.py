"""The gateway's settings: its HTTP server, per-request limits, overload control, API keys.

Part of the settings (libs/common/settings.py re-exports this class; import it from there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from flotilla.libs.common.common_settings import CommonSettings


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API")
    spec_path: Path | None = Field(None,
                                   description="OpenAPI spec file; default openapi/flotilla.yaml")
    max_n: int = Field(8, ge=1, le=128, description="Largest `n` (choices per request) accepted")
    model_ttl_s: float = Field(5.0, gt=0, description="A model unseen for this long is unlisted")
    ready_probe_timeout_s: float = Field(
        1.5, gt=0, description="/ready: how long each tokenizer, engine and tools instance has "
        "to answer its health probe; one that does not (frozen, wedged event loop) is not ready")
    engine_stall_s: float = Field(
        10.0, gt=0, description="/ready: an engine whose step loop has not gone round for this "
        "long (one step longer than this, or a wedged loop) is not ready")
    tools_timeout_s: float = Field(2.0, gt=0, description="How long to wait for the MCP tool list")
    tools_cache_ttl_s: float = Field(
        5.0, ge=0, description="How long the MCP tool list is reused (a tools service starting "
        "drops it at once); 0 = ask the tools service for every chat request")
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = Field(
        "reasoning_content",
        description="Name of the reasoning text in chat messages and deltas (both: send both)")
    mcp_call_timeout_s: float = Field(
        35.0, gt=0, description="How long the gateway waits for one MCP tool call it runs (the "
        "tools service's own per-call timeout, FLOTILLA_TOOL_CALL_TIMEOUT_S, should be shorter: "
        "the model then gets its timeout error as the call's result)")
    mcp_max_iterations: int = Field(
        8, ge=1, le=64, description="Model turns that may call MCP tools in one answer of the "
        "agent loop (/v1/responses, chat with injected tools); the turn after the last one "
        "runs without tools, so the model answers with what it has")
    responses_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="How long stored responses (/v1/responses with "
        "store, the default) are kept; in Redis when FLOTILLA_REDIS_URL is set")
    conversations_ttl_s: float = Field(
        30 * 24 * 3600.0, gt=0, description="How long a conversation (/v1/conversations) is kept "
        "after its last change; in Redis when FLOTILLA_REDIS_URL is set")
    conversation_max_items: int = Field(
        1000, ge=1, description="Most items one conversation may hold; adding more is a 400")
    conversation_max_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Most bytes (its items as JSON) one conversation "
        "may hold; adding more is a 400")
    gateway_workers: int = Field(
        1, ge=1, le=64, description="Gateway processes sharing the HTTP port, each with its own "
        "event loop and NATS connection (>1 spreads a burst's HTTP, validation and SSE work over "
        "cores; without Redis each keeps its own registry)")
    # ---- limits on one request (docs/architecture.md, "Limits and overload")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body in bytes; larger is 413 "
        "(a Content-Length above it before any byte is read)")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request line plus headers in bytes; larger is "
        "431 and the connection closes, before the rest is read")
    max_headers: int = Field(100, ge=8, description="Most header fields in one request; more is "
                             "431 and the connection closes")
    max_json_depth: int = Field(
        128, ge=8, le=1000, description="Deepest nesting of arrays and objects in a JSON body; "
        "deeper is 400")
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request")
    max_tools: int = Field(128, ge=1, description="Most tools in one request (OpenAI's limit)")
    max_schema_bytes: int = Field(
        64 * 1024, ge=256, description="Largest JSON of one tool's function (name, description, "
        "parameters schema) or of a response_format; larger is 400")
    max_stop: int = Field(16, ge=1, description="Most stop strings in one request")
    max_stop_chars: int = Field(512, ge=1, description="Longest stop string, in characters")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one /v1/completions request "
                             "(each with `n` choices)")
    max_embedding_inputs: int = Field(
        2048, ge=1, description="Most inputs in one /v1/embeddings request (OpenAI's limit), "
        "and most texts or documents in one score / rerank request")
    max_embedding_tokens: int = Field(
        300_000, ge=1, description="Most tokens the inputs of one embeddings, score or rerank "
        "request may hold together (OpenAI's limit); more is 400")
    # ---- overload control
    max_in_flight: int = Field(
        512, ge=1, description="Generation and tokenize requests one gateway process serves at "
        "once (a stream counts until it ends); beyond it 503 with Retry-After, never a queue")
    overload_retry_after_s: float = Field(
        1.0, gt=0, description="Retry-After sent with the gateway's own 503 when it is full")
    request_deadline_s: float = Field(
        600.0, gt=0, description="Longest a request may run (a client's X-Request-Timeout may "
        "ask for less); past it the gateway ends the response with a 504 / an error event and "
        "cancels the request on every hop")
    ui: bool = Field(False, description="Serve the chat web UI at / (same port and origin as "
                     "the API; its files ship in the package)")
    prometheus_multiproc_dir: Path | None = Field(
        None, validation_alias="PROMETHEUS_MULTIPROC_DIR", description="Directory where "
        "several gateway worker processes keep their metrics (prometheus-client's multiprocess "
        "mode, under its own variable's name); the parent of FLOTILLA_GATEWAY_WORKERS > 1 sets "
        "it for its workers. Unset = this process's metrics only")
    # ---- API keys and per-key limits (docs/security.md)
    api_keys: SecretStr | None = Field(
        None, description="API keys the gateway accepts, comma-separated (only their SHA-256 "
        "is kept); any key set here, in api_key_file or require_api_key turns authentication on")
    api_key_file: Path | None = Field(
        None, description="File of API keys, one a line (`#` starts a comment); a line may be "
        "`sha256:<hex>`, the key's SHA-256, so the file need not hold the key itself")
    require_api_key: bool = Field(
        False, description="Require an API key even when none is set here: the keys are the "
        "ones made with `flotilla keys create` (in Redis)")
    auth_open_paths: str = Field(
        "/health,/ready,/metrics", description="Paths answered without a key, comma-separated "
        "(GET / and /ui/*, the chat UI's page and files, always are)")
    key_rpm: int | None = Field(None, ge=1, description="Requests per minute of each key set "
                                "in api_keys / api_key_file; unset = unlimited")
    key_tpm: int | None = Field(None, ge=1, description="Tokens per minute (prompt + generated) "
                                "of each key set in api_keys / api_key_file; unset = unlimited")
    key_max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once "
                                           "per key set in api_keys / api_key_file")
    key_reserve_output_tokens: int = Field(
        1024, ge=1, description="Tokens per choice a keyed request that names no max_tokens "
        "reserves for its output against its tokens-per-minute limit (settled to the real "
        "count when it ends)")
    cors_origins: str | None = Field(
        None, description="Origins allowed to call the API from a browser, comma-separated "
        "(`*` = any); unset = no CORS headers (the chat UI is same-origin and needs none)")
