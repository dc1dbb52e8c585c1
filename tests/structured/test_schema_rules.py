"""JSON-schema keywords and structured outputs (services/tokenizer/schema_rules.py).

For every keyword refused: the refusal is a 400 naming the keyword's path, and xgrammar, given
the schema as it is, lets through an instance that jsonschema rejects (why it is refused; if a
newer xgrammar enforces one, that case fails and the keyword can be accepted). For every
rewrite: xgrammar lets a violation through the schema as it is and not through the rewrite, and
text sampled under the rewrite from random logits validates against the client's schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import GuidedDecoding, TextRequest
from flotilla.services.engine.structured import StructuredOutputs
from flotilla.services.tokenizer.guided import grammar_of, guided_spec
from flotilla.services.tokenizer.tokenizer import Tokenizer
from flotilla.services.tokenizer.tool_formats import HERMES
from tests.structured.test_constrained_sampling import generate

PARAM = "response_format.json_schema.schema"
OBJ = {"type": "object", "additionalProperties": False}


def spec_for(schema: Any) -> GuidedDecoding:
    req = TextRequest(request_id="r", model="m", kind="chat", stream_subject="s",
                      messages=[{"role": "user", "content": "x"}],
                      response_format={"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": schema}})
    spec = guided_spec(req, HERMES)
    assert spec is not None
    return spec


def raw_accepts(schema: Any, instance: Any) -> bool:
    """Whether xgrammar, given `schema` unchanged, accepts `instance` (as our JSON: `, ` `: `)."""
    raw = GuidedDecoding(kind="json_schema", value=json.dumps(schema))
    return _is_grammar_accept_string(grammar_of(raw), json.dumps(instance))


def accepts(spec: GuidedDecoding, instance: Any) -> bool:
    return _is_grammar_accept_string(grammar_of(spec), json.dumps(instance))


# (keyword path under the schema, schema, an instance jsonschema rejects that xgrammar accepts)
REFUSED = [
    ("properties.n.not", {**OBJ, "properties": {"n": {"type": "integer", "not": {"const": 3}}},
                          "required": ["n"]}, {"n": 3}),
    ("if", {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a"], "if": {"properties": {"a": {"const": 1}}},
            "then": {"required": ["b"]}}, {"a": 1}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    ("dependentRequired", {**OBJ, "properties": {"a": {"type": "integer"},
                                                 "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("dependentSchemas", {**OBJ, "properties": {"a": {"type": "integer"},
                                                "b": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 0.3),
    ("pattern", {"type": "string", "pattern": "^a+$", "maxLength": 3}, "aaaa"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    ("$ref", {"$defs": {"A": {"$anchor": "a", "type": "integer"}}, "$ref": "#a"}, "x"),
    ("items.$dynamicRef", {"$dynamicAnchor": "m", "type": "array",
                           "items": {"$dynamicRef": "#m"}}, [1]),
]


@pytest.mark.parametrize("path,schema,violation", REFUSED, ids=[c[0] for c in REFUSED])
def test_unenforceable_keywords_are_refused_naming_their_path(
        path: str, schema: dict[str, Any], violation: Any) -> None:
    assert not jsonschema.Draft202012Validator(schema).is_valid(violation)
    assert raw_accepts(schema, violation)  # why: xgrammar would let it through
    with pytest.raises(FlotillaError) as err:
        spec_for(schema)
    info = err.value.info
    assert info.status == 400 and info.param == f"{PARAM}.{path}", info
    assert path.rsplit(".", 1)[-1] in info.message


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "object", "properties": {"x": {"$id": "urn:x", "type": "string"}}}, "$id"),
    ({"$ref": "https://example.com/schema.json"}, "$ref"),
    ({"type": "array", "additionalItems": False}, "additionalItems"),
])
def test_keywords_outside_what_is_enforced_are_refused(schema: dict[str, Any],
                                                       keyword: str) -> None:
    with pytest.raises(FlotillaError) as err:
        spec_for(schema)
    assert err.value.info.status == 400 and err.value.info.param.endswith(keyword)


BASE = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                               "maximum": 9}}, "required": ["a"]}
# (name, schema, an instance jsonschema rejects that xgrammar accepts for the schema as it is)
REWRITTEN = [
    ("pydantic inheritance: allOf [$ref, {...}]",
     {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, {
         "type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}]},
     {}),
    ("allOf of two objects",
     {"allOf": [BASE, {"properties": {"c": {"type": "boolean"}}, "required": ["c"]}]},
     {"a": 1}),
    ("anyOf beside properties",
     {**BASE, "properties": {**BASE["properties"], "b": {"type": "boolean"},
                             "c": {"type": "boolean"}},
      "anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
     {"b": True}),
    ("$ref with a sibling bound",
     {"$defs": {"N": {"type": "integer", "maximum": 50}}, "$ref": "#/$defs/N", "minimum": 3},
     1),
    ("enum with a sibling length", {"type": "string", "enum": ["ok", "toolong"],
                                    "maxLength": 3}, "toolong"),
    ("required names not in properties",
     {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
      "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
     {"a": 1}),
    ("patternProperties over a declared property",
     {"type": "object", "properties": {"x1": {"type": "integer", "minimum": 0}},
      "patternProperties": {"^x": {"maximum": 5}}, "required": ["x1"]},
     {"x1": 7}),
    ("format beside a pattern", {"type": "string", "pattern": "^1[0-9]{3}-01-01$",
                                 "format": "date"}, "2020-01-01"),
]


@pytest.mark.parametrize("name,schema,violation", REWRITTEN, ids=[c[0] for c in REWRITTEN])
def test_rewrites_enforce_what_xgrammar_would_let_through(
        outputs: StructuredOutputs, smollm2: Tokenizer, name: str, schema: dict[str, Any],
        violation: Any) -> None:
    assert not jsonschema.Draft202012Validator(schema).is_valid(violation)
    assert raw_accepts(schema, violation)
    spec = spec_for(schema)
    assert not accepts(spec, violation)
    finished = 0
    for seed in range(4):  # random logits may wander into long numbers; most close in time
        ids, stopped = generate(outputs, smollm2, spec, seed, max_tokens=60)
        if stopped:
            finished += 1
            jsonschema.validate(json.loads(smollm2.decode(ids)), schema)
    assert finished


def test_discriminated_unions_and_disjoint_types_keep_one_of() -> None:
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {
        "type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "lives"]}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}
    pet = {"$defs": {"Cat": cat, "Dog": dog},
           "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
           "discriminator": {"propertyName": "kind"}}
    spec = spec_for(pet)
    assert accepts(spec, {"kind": "dog"}) and not accepts(spec, {"kind": "cat"})
    assert spec_for({"oneOf": [{"type": "string"}, {"type": "integer"}]}) is not None


def test_unsatisfiable_merges_are_refused() -> None:
    for schema in ({"allOf": [{"type": "string"}, {"type": "integer"}]},
                   {"allOf": [{**OBJ, "properties": {"a": {"type": "integer"}}},
                              {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
                   {"type": "string", "enum": ["long"], "maxLength": 2}):
        with pytest.raises(FlotillaError) as err:
            spec_for(schema)
        assert err.value.info.status == 400 and "no value can satisfy" in err.value.info.message


def test_recursive_definitions_still_work_and_self_merges_end() -> None:
    node = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "next": {"$ref": "#/$defs/Node"}},
            "required": ["v"]}
    spec = spec_for({"$defs": {"Node": node}, "allOf": [{"$ref": "#/$defs/Node"}]})
    assert accepts(spec, {"v": 1, "next": {"v": 2}}) and not accepts(spec, {"next": {"v": 2}})
    with pytest.raises(FlotillaError) as err:
        spec_for({"allOf": [{"$ref": "#"}], "type": "object"})
    assert err.value.info.status == 400
