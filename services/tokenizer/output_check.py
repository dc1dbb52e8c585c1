"""The finished text of a structured request checked against what its response format promised,
with independent readers (json, jsonschema), before the client is told it is complete.

Rules:
- `json_schema`: the text parses as JSON and validates against the client's schema (the original,
  not the rewrite xgrammar compiled) with jsonschema, Draft 2020-12, formats as annotations (the
  standard's default); `json_object`: the text is a JSON object; `choice`: the text is one of the
  choices. Other kinds (regex, grammar, structural tags) have no independent reader here.
- Only text that finished on its own (finish reason "stop") is checked: a reply cut by
  max_tokens is reported as "length", which already tells the client it is incomplete.
  Forced tool calls are checked by their own grammar and parser, not here.
- A violation is an error for the client (500 `invalid_structured_output`: the server failed to
  keep its promise), never a silent success. A schema this reader cannot evaluate (a pattern
  Python's `re` does not accept) is logged and not held against the output.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from flotilla.libs.common.messages import ErrorInfo, TextRequest
from flotilla.services.tokenizer.guided import forces_tool_calls

log = logging.getLogger(__name__)


def _violation(message: str) -> ErrorInfo:
    return ErrorInfo(status=500, type="server_error", code="invalid_structured_output",
                     message=f"the generated output does not match the response format: "
                             f"{message}")


@dataclass
class OutputCheck:
    kind: str
    schema: dict[str, Any] | None = None
    choices: list[str] | None = None

    @classmethod
    def for_request(cls, req: TextRequest) -> OutputCheck | None:
        fmt = req.response_format or {}
        kind = fmt.get("type", "text")
        if forces_tool_calls(req):
            return None
        if kind == "json_schema":
            return cls(kind, schema=(fmt.get("json_schema") or {}).get("schema"))
        if kind == "json_object":
            return cls(kind)
        if kind == "choice":
            return cls(kind, choices=list(fmt.get("choice") or []))
        return None

    def check(self, text: str) -> ErrorInfo | None:
        """None when `text` keeps the promise, else the error the client gets."""
        if self.kind == "choice":
            return None if text in (self.choices or []) else _violation(
                f"{text[:80]!r} is not one of the choices")
        try:
            value = json.loads(text)
        except ValueError as exc:
            return _violation(f"the text is not JSON ({exc})")
        if self.kind == "json_object":
            return None if isinstance(value, dict) else _violation("the text is not a JSON "
                                                                   "object")
        try:
            error = best_match(Draft202012Validator(self.schema or {}).iter_errors(value))
        except Exception:  # noqa: BLE001 - the reader's limits are not the output's fault
            log.warning("could not check an output against its schema", exc_info=True)
            return None
        if error is None:
            return None
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the top level"
        return _violation(f"at {where}: {error.message}")
