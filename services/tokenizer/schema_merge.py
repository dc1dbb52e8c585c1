"""Merging JSON Schemas the way `allOf` combines them, for schema_rules.py: one schema that
accepts exactly what every branch accepts, or an error saying why that cannot be written.

Rules:
- `SchemaMerger.merge(a, b)`: `a` is the node itself (or what was merged so far), `b` a
  branch. Keywords combine by their meaning: types intersect (integer within number), lower
  bounds take the larger and upper bounds the smaller, `required` and `properties` unite (a
  property one side does not declare must also satisfy that side's `additionalProperties` or
  matching `patternProperties`), `enum`s intersect, `multipleOf`s take their lcm, `items` /
  `propertyNames` and common properties become an `allOf` (merged in turn), two `anyOf` lists
  their cross product (at most MAX_BRANCHES). Annotations and unknown keywords keep `a`'s.
- What cannot be written as one node (two different `pattern`s or `prefixItems`, both sides
  with `patternProperties`, `unevaluated*` inside a branch, ...) is a 400 naming the keyword;
  what admits no value raises `Unsatisfiable` (the caller drops an anyOf branch or refuses).
- `$ref` is resolved against the root (`#` and `#/...` pointers) one level at a time; merges
  and resolutions are counted (MAX_STEPS), so recursive definitions end in a 400, not a hang.
- `disjoint(branches)`: whether no value can match two of them (by types, finite values, or a
  required property whose `const` / `enum` values differ: discriminated unions).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any
from urllib.parse import unquote

from flotilla.libs.common.errors import FlotillaError, invalid_request

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "$comment", "$schema", "$id", "$anchor", "$dynamicAnchor", "$defs", "definitions",
    "$vocabulary", "format", "contentEncoding", "contentMediaType", "contentSchema",
    "minContains", "maxContains"})  # the last two do nothing without `contains` (refused)
CONSTRAINTS = frozenset({
    "type", "const", "enum", "$ref", "allOf", "anyOf", "oneOf", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "required", "minProperties",
    "maxProperties", "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
MAX_STEPS = 2_000  # merges and resolutions per schema
MAX_BRANCHES = 64


class Unsatisfiable(Exception):
    """No instance can satisfy the node at `path` (the message says why)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path



def norm_value(v: Any) -> str:
    """Canonical text of a JSON value, numbers compared by value (1 == 1.0)."""
    def fix(x: Any) -> Any:
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, dict):
            return {k: fix(y) for k, y in x.items()}
        if isinstance(x, list):
            return [fix(y) for y in x]
        return x
    return json.dumps(fix(v), sort_keys=True)


def types_of(node: Any) -> set[str] | None:
    if not isinstance(node, dict) or "type" not in node:
        return None
    t = node["type"]
    return {t} if isinstance(t, str) else set(t)


class SchemaMerger:
    """Merges and resolves within one root schema; errors name `param`.<path>."""

    def __init__(self, root: dict[str, Any], param: str):
        self.root, self.param = root, param
        self.steps = 0

    def fail(self, path: str, message: str) -> FlotillaError:
        where = f"{self.param}.{path}" if path else self.param
        return invalid_request(f"{where}: {message}", param=where, code="invalid_json_schema")

    def _step(self, path: str) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise self.fail(path, "the schema's allOf / $ref structure is too deep to merge")

    def resolve(self, ref: str, path: str) -> Any:
        node: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.fail(join(path, "$ref"), f"{ref!r} does not resolve")
        return node

    def deref(self, node: Any, path: str) -> Any:
        """`node` with a leading `$ref` replaced by its target (siblings merged in)."""
        seen: set[str] = set()
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            self._step(path)
            ref = node["$ref"]
            if ref in seen:
                raise self.fail(join(path, "$ref"), "the reference never reaches a schema")
            seen.add(ref)
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = self.merge(self.resolve(ref, path), rest, path)
        return node

    def _applies(self, node: dict[str, Any], name: str, path: str,
                 unevaluated: bool = False) -> Any:
        """The schema a property `name` that `properties` does not declare must satisfy
        (`unevaluated`: counting `unevaluatedProperties`, i.e. for the node as a whole)."""
        patterns = node.get("patternProperties") or {}
        matched = [s for p, s in patterns.items() if search(p, name, self, path)]
        if matched:
            return all_of(*matched)
        if "additionalProperties" in node or not unevaluated:
            return node.get("additionalProperties", True)
        return node.get("unevaluatedProperties", True)

    # ---------------------------------------------------------------- merging (allOf)

    def merge(self, a: Any, b: Any, path: str) -> Any:
        """One schema accepting what both accept. `a` is the node itself or what was merged so
        far; `b` is a branch (so `unevaluated*` in it would see less than in the merge)."""
        self._step(path)
        if a is False or b is False:
            raise Unsatisfiable("a branch is `false`", path)
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in b:
                raise self.fail(join(path, key), f"`{key}` inside an allOf branch cannot be "
                                "merged; put it on the node that holds the allOf")
        b = self.deref(b, path)
        out = dict(a)
        if _objectish(a) and _objectish(b):
            out.update(self._merge_objects(a, b, path))
        for key, value in b.items():
            if key in ("properties", "additionalProperties", "required") and _objectish(a) \
                    and _objectish(b):
                continue
            if key not in out or out[key] == value:
                out[key] = value
            else:
                out[key] = self._merge_keyword(key, out[key], value, path)
        return out

    def _merge_objects(self, a: dict[str, Any], b: dict[str, Any], path: str) -> dict[str, Any]:
        for x, y in ((a, b), (b, a)):
            if x.get("patternProperties") and (y.get("patternProperties")
                                               or "additionalProperties" in y):
                raise self.fail(join(path, "patternProperties"), "`patternProperties` with "
                                "`patternProperties` or `additionalProperties` in another "
                                "allOf branch cannot be merged")
        pa, pb = a.get("properties") or {}, b.get("properties") or {}
        props = {}
        for name in dict.fromkeys([*pa, *pb]):
            sa = pa[name] if name in pa else self._applies(a, name, path)
            sb = pb[name] if name in pb else self._applies(b, name, path)
            props[name] = all_of(sa, sb)
        out: dict[str, Any] = {"properties": props} if props else {}
        required = list(dict.fromkeys([*(a.get("required") or []), *(b.get("required") or [])]))
        if required:
            out["required"] = required
        for name in required:
            if props.get(name) is False:
                raise Unsatisfiable(f"`{name}` is required by one branch and not allowed by "
                                     "another", path)
        out["properties"] = {k: v for k, v in props.items() if v is not False} if props else {}
        if not out["properties"]:
            del out["properties"]
        adds = [x["additionalProperties"] for x in (a, b) if "additionalProperties" in x]
        if adds:
            out["additionalProperties"] = all_of(*adds)
        return out

    def _merge_keyword(self, key: str, x: Any, y: Any, path: str) -> Any:
        if key == "type":
            tx, ty = types_of({"type": x}) or set(), types_of({"type": y}) or set()
            both = (tx & ty) | ({"integer"} if ("integer" in tx and "number" in ty) or (
                "number" in tx and "integer" in ty) else set())
            if not both:
                raise Unsatisfiable(f"types {sorted(tx)} and {sorted(ty)} do not overlap", path)
            return sorted(both)[0] if len(both) == 1 else sorted(both)
        if key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
            return max(x, y)
        if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
            return min(x, y)
        if key == "multipleOf" and float(x).is_integer() and float(y).is_integer():
            return math.lcm(int(x), int(y))
        if key == "enum":
            ys = {norm_value(v) for v in y}
            common = [v for v in x if norm_value(v) in ys]
            if not common:
                raise Unsatisfiable("the branches' `enum`s have no value in common", path)
            return common
        if key == "const":
            if norm_value(x) != norm_value(y):
                raise Unsatisfiable("the branches' `const`s differ", path)
            return x
        if key in ("items", "propertyNames", "contentSchema"):
            return all_of(x, y)
        if key == "anyOf":
            pairs = [all_of(p, q) for p in x for q in y]
            if len(pairs) > MAX_BRANCHES:
                raise self.fail(join(path, key), "merging these anyOf lists gives too many "
                                "branches")
            return pairs
        if key in ANNOTATIONS or key not in CONSTRAINTS:
            return x  # annotations and unknown keywords: the first one stays
        raise self.fail(join(path, key), f"two different `{key}` values in one allOf cannot "
                        "be merged into one schema")


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path and not key.startswith("[") else f"{path}{key}"


def all_of(*schemas: Any) -> Any:
    """allOf of `schemas` (rewritten later), without the trivial ones."""
    if any(s is False for s in schemas):
        return False
    real = [s for s in schemas if s is not True and s != {}]
    if not real:
        return True
    return real[0] if len(real) == 1 else {"allOf": real}


def _objectish(node: dict[str, Any]) -> bool:
    return bool({"properties", "additionalProperties", "required", "patternProperties"}
                & node.keys())


def search(pattern: str, name: str, rw: SchemaMerger, path: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        raise rw.fail(join(path, "patternProperties"), f"pattern {pattern!r} is not a "
                      "regular expression this server can apply") from None


def _facts(node: Any) -> tuple[set[str] | None, set[str] | None, dict[str, set[str]]]:
    """What a oneOf branch admits: its types, its finite values, and required properties with
    finite values (the discriminators)."""
    if not isinstance(node, dict):
        return None, None, {}
    values = None
    if "const" in node:
        values = {norm_value(node["const"])}
    elif "enum" in node:
        values = {norm_value(v) for v in node["enum"]}
    types = types_of(node)
    if values is not None:
        kinds = {_json_type(json.loads(v)) for v in values}
        types = kinds if types is None else types & (kinds | {"number"})
    discriminators = {}
    for name in node.get("required") or []:
        prop = (node.get("properties") or {}).get(name)
        _, finite, _ = _facts(prop)
        if finite is not None:
            discriminators[name] = finite
    return types, values, discriminators


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null")


def _disjoint(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> bool:
    (ta, va, da), (tb, vb, db) = a, b
    if va is not None and vb is not None and not va & vb:
        return True
    if ta is not None and tb is not None:
        widen = {"number": {"number", "integer"}, "integer": {"number", "integer"}}
        wa = set().union(*(widen.get(t, {t}) for t in ta))
        if not wa & tb:
            return True
    return any(not (da[k] & db[k]) for k in da.keys() & db.keys())


def disjoint(branches: list[Any]) -> tuple[int, int] | None:
    """None when no value can match two of `branches` (each already resolved), else the first
    pair of indices that may overlap."""
    facts = [_facts(b) for b in branches]
    for i in range(len(facts)):
        for j in range(i + 1, len(facts)):
            if not _disjoint(facts[i], facts[j]):
                return i, j
    return None
