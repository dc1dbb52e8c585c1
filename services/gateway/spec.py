"""The OpenAPI document: found once at start, served verbatim, and used to validate request bodies.

Rules:
- The file is the source of truth. `/openapi.json` serves exactly what it holds (as JSON), and each
  operation's request body is validated against the schema the file names for it, so what we
  document and what we enforce cannot drift apart.
- Lookup order: `settings.spec_path`, then `openapi/flotilla.yaml` of the source tree, then the copy
  packaged next to this module (`services/gateway/flotilla.yaml`, a link to the same file that
  setuptools copies into wheels as package data).
- Bounds owned by a server setting carry `x-limit: {keyword: setting}` in the file; `limits`
  (setting → value, from `limits.spec_limits`) are written into those keywords, and into
  `{setting}` placeholders of `x-error-message` texts, when the document is loaded. What is
  served and what is enforced is then the running server's contract; without `limits` the
  file's own numbers (the defaults) stand.
- `jsonschema` (pure Python) is the reference validator: it decides every rejection and explains
  it (validation.py). A compiled validator (`jsonschema_rs`, built once per operation at start)
  only answers "valid" for the common case, ~3 us instead of ~0.6 ms for a chat body; whatever
  it does not accept (or cannot read) goes to the reference, so no body the reference accepts is
  refused and every 400 reads the same. Without `jsonschema_rs` the reference does everything.
- The reference costs ~0.5 ms per chat message, so a large invalid body (2,048 messages and one
  bad field: 1.6 s of CPU) would let one client burn the gateway's time. A rejected body of
  more than `REFERENCE_NODES` JSON values is explained from the compiled validator's first
  error instead: the reference checks only the failing part (the value at the error's path
  against the subschema that refused it) when that part is small, and otherwise the compiled
  error itself is put into words (validation.describe_compiled).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from flotilla.services.gateway.validation import describe, describe_compiled

try:
    import jsonschema_rs
except ImportError:  # a declared dependency; without it every body takes the reference path
    jsonschema_rs = None  # type: ignore[assignment]

SPEC_NAME = "flotilla.yaml"
REFERENCE_NODES = 2000  # rejected bodies up to this many JSON values are explained whole
_SPEC_URI = "urn:flotilla:openapi"
_HERE = Path(__file__).resolve().parent


def spec_candidates(explicit: Path | None = None) -> list[Path]:
    if explicit is not None:
        return [Path(explicit)]
    return [_HERE.parents[1] / "openapi" / SPEC_NAME, _HERE / SPEC_NAME]


def find_spec(explicit: Path | None = None) -> Path:
    """The spec file to load; a clear error naming every place looked at when none exists."""
    candidates = spec_candidates(explicit)
    for path in candidates:
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"OpenAPI spec not found (looked at {tried}); set FLOTILLA_SPEC_PATH")


class Spec:
    """A loaded OpenAPI 3.1 document with one request-body validator per operation."""

    def __init__(self, path: Path, compiled: bool = True,
                 limits: Mapping[str, int] | None = None):
        """`compiled=False`: the reference validator alone (what runs without jsonschema_rs);
        `limits`: the settings that `x-limit` keywords name (see the module rules)."""
        self.path = path
        self.document: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not str(self.document.get("openapi", "")).startswith("3.1"):
            raise ValueError(f"{path}: expected an OpenAPI 3.1 document")
        apply_limits(self.document, limits)
        self.json_bytes = json.dumps(self.document, ensure_ascii=False).encode()
        registry: Registry = Registry().with_resource(
            _SPEC_URI, Resource.from_contents(self.document, default_specification=DRAFT202012))
        self._registry = registry
        self._validators: dict[str, Draft202012Validator] = {}
        self._fast: dict[str, Any] = {}  # operation → compiled validator (see the module rules)
        fast_registry = None
        if compiled and jsonschema_rs is not None:
            fast_registry = jsonschema_rs.Registry([(_SPEC_URI, self.document)],
                                                   draft=jsonschema_rs.Draft202012)
        for operation_id, ref in self._request_schema_refs().items():
            schema = {"$ref": _SPEC_URI + ref}
            self._validators[operation_id] = Draft202012Validator(schema, registry=registry)
            if fast_registry is not None:
                self._fast[operation_id] = jsonschema_rs.Draft202012Validator(
                    schema, registry=fast_registry)

    @classmethod
    def load(cls, explicit: Path | None = None, compiled: bool = True,
             limits: Mapping[str, int] | None = None) -> Spec:
        return cls(find_spec(explicit), compiled, limits)

    def _request_schema_refs(self) -> dict[str, str]:
        refs: dict[str, str] = {}
        for path_item in self.document.get("paths", {}).values():
            for operation in path_item.values():
                if not isinstance(operation, dict) or "requestBody" not in operation:
                    continue
                schema = operation["requestBody"]["content"]["application/json"]["schema"]
                refs[operation["operationId"]] = schema["$ref"]
        return refs

    @property
    def compiled(self) -> bool:
        """Whether a compiled validator answers for the valid bodies (see the module rules)."""
        return bool(self._fast)

    @property
    def operations(self) -> list[str]:
        return sorted(self._validators)

    def validate(self, operation_id: str, body: Any) -> None:
        """Raise FlotillaError (400, naming the parameter) when `body` breaks the schema."""
        fast = self._fast.get(operation_id)
        if fast is not None:
            if _accepts(fast, body):
                return
            if not _within(body, REFERENCE_NODES):
                first = _first_error(fast, body)
                if first is not None:
                    raise self._describe_part(first, body)
        errors = list(self._validators[operation_id].iter_errors(body))
        if errors:
            raise describe(errors)

    def _describe_part(self, error: Any, body: Any) -> Exception:
        """The 400 for a large body the compiled validator refused (see the module rules)."""
        path = list(error.instance_path)
        part = body
        for key in path:
            part = part[key]
        where = [str(p) for p in error.schema_path][:-1]
        schema: Any = self.document
        for key in where:
            schema = schema[int(key)] if isinstance(schema, list) else schema[key]
        if _within(part, REFERENCE_NODES):
            pointer = "/".join(k.replace("~", "~0").replace("/", "~1") for k in where)
            validator = Draft202012Validator({"$ref": f"{_SPEC_URI}#/{pointer}"},
                                             registry=self._registry)
            errors = list(validator.iter_errors(part))
            if errors:
                for e in errors:
                    e.path.extendleft(reversed(path))
                return describe(errors)
        return describe_compiled(error, part, schema)


def apply_limits(document: Any, limits: Mapping[str, int] | None = None) -> None:
    """Write the settings each `x-limit` names into its keywords, and into `{setting}`
    placeholders of `x-error-message` texts, in place. Without `limits` the file's own numbers
    fill the placeholders; a setting `limits` lacks is a ValueError."""
    nodes: list[dict[str, Any]] = []
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            nodes.append(node)
            stack.extend(node.values())
    values = {setting: node.get(keyword) for node in nodes
              for keyword, setting in (node.get("x-limit") or {}).items()}
    if limits is not None:
        unknown = sorted(set(values) - set(limits))
        if unknown:
            raise ValueError(f"the spec's x-limit names unknown settings: {', '.join(unknown)}")
        values = {setting: limits[setting] for setting in values}
    for node in nodes:
        for keyword, setting in (node.get("x-limit") or {}).items():
            node[keyword] = values[setting]
        message = node.get("x-error-message")
        if isinstance(message, str):
            for setting, value in values.items():
                message = message.replace("{" + setting + "}", str(value))
            node["x-error-message"] = message


def _within(value: Any, limit: int) -> bool:
    """Whether `value` holds at most `limit` JSON values (stops counting past it)."""
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        count += 1
        if count > limit:
            return False
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            count += sum(1 for v in node if not isinstance(v, (dict, list)))
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return count <= limit


def _first_error(validator: Any, body: Any) -> Any:
    try:
        return next(iter(validator.iter_errors(body)), None)
    except Exception:  # a value it cannot convert (an integer past 64 bits): ask the reference
        return None


def _accepts(validator: Any, body: Any) -> bool:
    try:
        return bool(validator.is_valid(body))
    except Exception:  # a value it cannot convert (e.g. an integer past 64 bits): ask the reference
        return False
