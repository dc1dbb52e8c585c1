"""Which JSON Schema keywords structured outputs can promise, and the rewrites that let xgrammar
enforce more of them. `enforceable(schema, param)` returns the schema to compile, or raises a
400 whose `param` is `<param>.<path of the keyword>`.

What xgrammar 0.2.8 does (each point is checked by tests/structured/test_schema_rules.py, which
generates a violating instance through xgrammar's own matcher): it converts a node by one leading
keyword — `$ref`, else `const`, else `enum`, else `anyOf`, else `oneOf`, else `allOf`, else
`type` — and drops the node's other constraints; `allOf` of several branches and `oneOf` whose
branches it cannot prove disjoint are read as `anyOf`; a `pattern` or a `format` drops
`minLength`/`maxLength` and a `format` drops a `pattern`; `required` names that `properties`
does not declare are not generated; `patternProperties` is not applied to declared properties;
`multipleOf` is applied to integers only; these keywords are skipped: `not`, `if`/`then`/`else`,
`dependentRequired`, `dependentSchemas`, `uniqueItems`, `contains`/`maxContains`,
`$dynamicRef`, anchor refs (`#name`).

Rules:
- Refused (400): everything in REFUSED (with the condition noted there), `multipleOf` unless the
  node is an integer one with a whole multiple, `pattern` together with `minLength`/`maxLength`,
  `$ref` other than `#` and `#/...`, `$id` below the root, and `oneOf` whose branches this
  module cannot prove disjoint (by type, by finite values, or by a required property with
  disjoint `const`/`enum` values: pydantic's discriminated unions).
- Rewritten (the result accepts what the original accepts; where it cannot, the merge is
  refused):
  `allOf` is merged into its node (`$ref` branches resolved one level first); a `$ref`,
  `anyOf` or `oneOf` with constraining siblings gets them merged into the target / each branch
  (branches the merge makes unsatisfiable are dropped); `enum` / `const` with constraining
  siblings keep only the values that satisfy the whole node (checked with jsonschema); required
  names missing from `properties` are declared there with the schema that applies to them;
  `patternProperties` schemas are merged into the declared properties they match; a `format`
  is dropped where xgrammar would drop a `pattern` or a length for it (`format` is an
  annotation in JSON Schema 2020-12); fractional bounds of integers are rounded inwards.
  A merge JSON Schema allows but one node cannot express (two different `pattern`s, both sides
  with `patternProperties` or `prefixItems`, `unevaluated*` inside a branch) is refused naming
  the keyword; one that leaves nothing possible is refused as unsatisfiable.
- Accepted as they are: the other validation keywords, annotations (title, description, default,
  examples, format, content*, deprecated, readOnly, writeOnly, $comment, $schema, $anchor,
  $defs/definitions) and unknown keywords (JSON Schema ignores them). xgrammar reads `pattern`
  and `patternProperties` as full matches (JSON Schema: a match anywhere), which only ever
  accepts less.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jsonschema import Draft202012Validator

from flotilla.services.tokenizer.schema_merge import (
    CONSTRAINTS,
    SchemaMerger,
    Unsatisfiable,
    all_of,
    disjoint,
    join,
    search,
    types_of,
)

# keyword -> when it is refused (True: whenever present with a value that constrains)
REFUSED: dict[str, Callable[[dict[str, Any]], bool]] = {
    "not": lambda n: True,
    "if": lambda n: "then" in n or "else" in n,
    "dependentRequired": lambda n: any(n["dependentRequired"].values()),
    "dependentSchemas": lambda n: bool(n["dependentSchemas"]),
    "dependencies": lambda n: bool(n["dependencies"]),
    "uniqueItems": lambda n: n["uniqueItems"] is True,
    "contains": lambda n: True,
    "$dynamicRef": lambda n: True,
    "$recursiveRef": lambda n: True,
    "additionalItems": lambda n: True,
}
_ONE = ("additionalProperties", "propertyNames", "items", "unevaluatedItems",
        "unevaluatedProperties", "contentSchema")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAX_NESTING = 64  # rewrite levels (the schema itself may nest MAX_DEPTH = 32)


class _Rewriter(SchemaMerger):
    def __init__(self, root: dict[str, Any], param: str):
        super().__init__(root, param)
        self.depth = 0
        self._validator = Draft202012Validator(root)

    def check(self, node: Any, path: str) -> None:
        """Raise for every refused keyword in `node` and below."""
        if not isinstance(node, dict):
            return
        for key, refused in REFUSED.items():
            if key in node and refused(node):
                raise self.fail(join(path, key), f"`{key}` cannot be enforced during "
                                "generation; this server refuses it rather than ignore it")
        if "$id" in node and path:
            raise self.fail(join(path, "$id"), "`$id` is supported at the root only")
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            raise self.fail(join(path, "$ref"), f"only local references (`#`, `#/...`) are "
                            f"supported, not {ref!r}")
        for child, sub in _children(node, path):
            self.check(child, sub)

    # ---------------------------------------------------------------- the rewrite

    def rewrite(self, node: Any, path: str) -> Any:
        """`node` with its subschemas rewritten, then itself (see module rules)."""
        if not isinstance(node, dict):
            return node
        self.depth += 1
        try:
            return self._rewrite(dict(node), path)
        finally:
            self.depth -= 1

    def _rewrite(self, node: dict[str, Any], path: str) -> Any:
        if self.depth > _MAX_NESTING:
            raise self.fail(path, "the schema nests too deeply once its allOf / $ref are "
                            "resolved")
        for key in _ONE:
            if isinstance(node.get(key), dict | bool):
                node[key] = self.rewrite(node[key], join(path, key))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                node[key] = {name: self.rewrite(s, join(path, f"{key}.{name}"))
                             for name, s in node[key].items()}
        if isinstance(node.get("prefixItems"), list):
            node["prefixItems"] = [self.rewrite(s, join(path, f"prefixItems[{i}]"))
                                   for i, s in enumerate(node["prefixItems"])]
        if isinstance(node.get("allOf"), list):
            node["allOf"] = [self.rewrite(s, join(path, f"allOf[{i}]"))
                             for i, s in enumerate(node["allOf"])]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                node[key] = self._branches(node[key], key, path)
        return self._normalize(node, path)

    def _branches(self, branches: list[Any], key: str, path: str) -> list[Any]:
        """The rewritten branches of an anyOf / oneOf, without those nothing can match."""
        out = []
        for i, branch in enumerate(branches):
            try:
                out.append(self.rewrite(branch, join(path, f"{key}[{i}]")))
            except Unsatisfiable:
                continue
        if not out:
            raise Unsatisfiable(f"no `{key}` branch can match anything", join(path, key))
        return out

    def _normalize(self, node: dict[str, Any], path: str) -> Any:
        constraining = {k for k in node if k in CONSTRAINTS}
        if "allOf" in node:
            merged: Any = {k: v for k, v in node.items() if k != "allOf"}
            for i, branch in enumerate(node["allOf"]):
                merged = self.merge(merged, self.deref(branch, path), join(path, f"allOf[{i}]"))
            return self.rewrite(merged, path)
        if "$ref" in node and constraining - {"$ref"}:
            return self.rewrite(self.merge(
                self.deref({"$ref": node["$ref"]}, path),
                {k: v for k, v in node.items() if k != "$ref"}, path), path)
        for key in ("anyOf", "oneOf"):
            if key in node and constraining - {key}:
                return self.rewrite(self._distribute(node, key, path), path)
        if ("enum" in node or "const" in node) and constraining - {"enum", "const"}:
            return self._filter_values(node, path)
        if "oneOf" in node:
            overlap = disjoint([self.deref(b, path) for b in node["oneOf"]])
            if overlap is not None:
                raise self.fail(join(path, "oneOf"), f"branches {overlap[0]} and {overlap[1]} "
                                "may both match a value, so `oneOf` (exactly one) cannot be "
                                "enforced; use `anyOf`, or give each branch a distinct `const` "
                                "on a required property")
        return self._fix_leaf(node, path)

    def _distribute(self, node: dict[str, Any], key: str, path: str) -> dict[str, Any]:
        rest = {k: v for k, v in node.items() if k != key and k in CONSTRAINTS}
        keep = {k: v for k, v in node.items() if k != key and k not in CONSTRAINTS}
        branches = []
        for i, branch in enumerate(node[key]):
            try:
                branches.append(self.merge(rest, self.deref(branch, path),
                                           join(path, f"{key}[{i}]")))
            except Unsatisfiable:
                continue  # this branch can never match together with the siblings
        if not branches:
            raise Unsatisfiable(f"no `{key}` branch is compatible with its sibling keywords",
                                 path)
        return {**keep, key: branches}

    def _filter_values(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        values = [node["const"]] if "const" in node else list(node["enum"])
        check = self._validator.evolve(schema=node)
        kept = [v for v in values if check.is_valid(v)]
        if not kept:
            raise Unsatisfiable("no value of its `enum` / `const` satisfies its other "
                                 "keywords", path)
        out = {k: v for k, v in node.items() if k not in CONSTRAINTS}
        return {**out, "enum": kept}

    def _fix_leaf(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        types = types_of(node)
        if "multipleOf" in node:
            m = node["multipleOf"]
            if types is None or "number" in types or not float(m).is_integer():
                raise self.fail(join(path, "multipleOf"), "`multipleOf` can be enforced only "
                                "on integers (`type: integer`) with a whole multiple")
        if "pattern" in node and ("minLength" in node or "maxLength" in node):
            raise self.fail(join(path, "pattern"), "`pattern` together with `minLength` / "
                            "`maxLength` cannot be enforced; put the length into the pattern")
        if "format" in node and ({"pattern", "minLength", "maxLength"} & node.keys()):
            node = {k: v for k, v in node.items() if k != "format"}
        if types == {"integer"}:
            node = _integer_bounds(node)
        return self._fix_object(node, path)

    def _fix_object(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        types = types_of(node)
        props = dict(node.get("properties") or {})
        patterns = node.get("patternProperties") or {}
        required = node.get("required") or []
        if (types is not None and "object" not in types) or not (
                patterns or any(r not in props for r in required)):
            return node
        changed: dict[str, Any] = {}
        for name in required:
            if name not in props:
                changed[name] = self._applies(node, name, path, unevaluated=True)
        for name, schema in props.items():
            extra = [s for p, s in patterns.items() if search(p, name, self, path)]
            if extra:
                changed[name] = all_of(schema, *extra)
        for name, schema in changed.items():
            if schema is False and name in required:
                raise Unsatisfiable(f"`{name}` is required but no value is allowed for it",
                                     join(path, "required"))
            props[name] = self.rewrite(schema, join(path, f"properties.{name}"))
        return {**node, "properties": props}

def _children(node: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    """(subschema, its path) for every direct subschema of `node`."""
    out: list[tuple[Any, str]] = []
    for key in _ONE:
        if isinstance(node.get(key), dict | bool):
            out.append((node[key], join(path, key)))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out += [(s, join(path, f"{key}.{name}")) for name, s in node[key].items()]
    for key in _LIST:
        if isinstance(node.get(key), list):
            out += [(s, join(path, f"{key}[{i}]")) for i, s in enumerate(node[key])]
    return out


def _integer_bounds(node: dict[str, Any]) -> dict[str, Any]:
    """Whole-number bounds for an integer node (xgrammar refuses fractional ones)."""
    out = dict(node)
    for key, rounding in (("minimum", math.ceil), ("maximum", math.floor)):
        if isinstance(out.get(key), float):
            out[key] = rounding(out[key])
    if isinstance(out.get("exclusiveMinimum"), float):
        out["minimum"] = max(math.floor(out.pop("exclusiveMinimum")) + 1,
                             out.get("minimum", -math.inf))
    if isinstance(out.get("exclusiveMaximum"), float):
        out["maximum"] = min(math.ceil(out.pop("exclusiveMaximum")) - 1,
                             out.get("maximum", math.inf))
    return out


def enforceable(schema: dict[str, Any], param: str) -> dict[str, Any]:
    """The schema xgrammar gets for `schema` (see module rules), or a 400 naming the keyword."""
    rewriter = _Rewriter(schema, param)
    rewriter.check(schema, "")
    try:
        out = rewriter.rewrite(schema, "")
    except Unsatisfiable as exc:
        raise rewriter.fail(exc.path, f"no value can satisfy this schema: {exc}") from None
    return out if isinstance(out, dict) else {}
