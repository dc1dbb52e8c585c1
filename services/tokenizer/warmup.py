"""Start-up warm-up: what a first request would otherwise load inside its time budget (xgrammar's
import alone took 3.5-5.5 s on a busy 2-core machine, and the first structured request after
each start failed with the template's budget error).

`warm_up(builder)` runs before the service subscribes and announces itself: it imports xgrammar,
renders the chat template (plain, with tools, with tools forced), tokenizes, builds a grammar of
every kind (JSON schema, forced tool calls, regex, choice, GBNF, structural tag) and validates a
JSON document against a schema, as the output check does. A model without a chat template
skips the chat part; any other failure is logged, never fatal (the request that meets it gets
its error then).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from jsonschema import Draft202012Validator

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import TextRequest
from flotilla.services.tokenizer.guided import xgrammar
from flotilla.services.tokenizer.prompt import PromptBuilder

log = logging.getLogger(__name__)

_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "n": {"type": "integer"}}, "required": ["name"]}
_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                          "parameters": _SCHEMA}}
_FORMATS: list[dict[str, Any]] = [
    {"type": "json_schema", "json_schema": {"name": "warm", "schema": _SCHEMA}},
    {"type": "json_object"},
    {"type": "regex", "regex": "[a-z]{1,8}"},
    {"type": "choice", "choice": ["yes", "no"]},
    {"type": "grammar", "grammar": 'root ::= "a" | ws "b"\nws ::= | " "'},
    {"type": "structural_tag", "structural_tag": {"format": {
        "type": "tag", "begin": "<x>", "content": {"type": "json_schema", "json_schema": _SCHEMA},
        "end": "</x>"}}},
]


def _requests() -> list[TextRequest]:
    def chat(**kw: Any) -> TextRequest:
        return TextRequest(request_id="warm-up", model="warm-up", kind="chat",
                           stream_subject="warm-up",
                           messages=[{"role": "user", "content": "Hello"}], **kw)

    completions = [TextRequest(request_id="warm-up", model="warm-up", kind="completion",
                               stream_subject="warm-up", prompt="Hello", response_format=f)
                   for f in _FORMATS]
    return [chat(response_format=_FORMATS[0]), chat(tools=[_TOOL]),
            chat(tools=[_TOOL], tool_choice="required"), *completions]


def warm_up(builder: PromptBuilder) -> float:
    """Load and exercise everything above (blocking: seconds); returns the seconds it took."""
    start = time.monotonic()
    xgrammar()
    for req in _requests():
        try:
            builder.prepare(req)
        except FlotillaError as exc:  # e.g. no chat template: nothing of it to warm
            log.debug("warm-up request skipped: %s", exc.info.message)
        except Exception:  # noqa: BLE001 - the request that meets it gets the error then
            log.warning("tokenizer warm-up: a %s request failed", req.kind, exc_info=True)
    Draft202012Validator(_SCHEMA).is_valid({"name": "x"})
    return time.monotonic() - start
