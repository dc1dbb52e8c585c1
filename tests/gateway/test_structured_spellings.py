"""Every structured-output spelling clients send (OpenAI, vLLM's two generations, llama.cpp)
reaches the tokenizer as the one internal `response_format` that TextRequest's docstring
defines, on chat and on completions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.fakes import FakeTokenizer
from tests.gateway.test_param_mapping import sent

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
GBNF = 'root ::= "yes" | "no"'
TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
OLD_TAG = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]}

SPELLINGS: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = [
    ("openai text", {"response_format": {"type": "text"}}, None),
    ("openai json_object", {"response_format": {"type": "json_object"}},
     {"type": "json_object"}),
    ("openai json_schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}},
     {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}),
    ("llama.cpp response_format schema", {"response_format": {"type": "json_object",
                                                              "schema": SCHEMA}}, AS_SCHEMA),
    ("llama.cpp json_schema type with schema", {"response_format": {"type": "json_schema",
                                                                    "schema": SCHEMA}},
     AS_SCHEMA),
    ("vLLM response_format structural_tag", {"response_format": TAG},
     {"type": "structural_tag", "structural_tag": TAG}),
    ("vLLM older structural_tag", {"response_format": OLD_TAG},
     {"type": "structural_tag", "structural_tag": OLD_TAG}),
    ("structured_outputs json", {"structured_outputs": {"json": SCHEMA}}, AS_SCHEMA),
    ("structured_outputs json text", {"structured_outputs": {
        "json": '{"type": "object", "properties": {"a": {"type": "integer"}}, '
                '"required": ["a"]}', "disable_any_whitespace": True}}, AS_SCHEMA),
    ("structured_outputs regex", {"structured_outputs": {"regex": "[a-z]+"}},
     {"type": "regex", "regex": "[a-z]+"}),
    ("structured_outputs choice", {"structured_outputs": {"choice": ["yes", "no"]}},
     {"type": "choice", "choice": ["yes", "no"]}),
    ("structured_outputs grammar", {"structured_outputs": {"grammar": GBNF}},
     {"type": "grammar", "grammar": GBNF}),
    ("structured_outputs json_object", {"structured_outputs": {
        "json_object": True, "disable_additional_properties": False}},
     {"type": "json_object"}),
    ("structured_outputs structural_tag", {"structured_outputs": {
        "structural_tag": '{"type": "structural_tag", "format": {"type": "const_string", '
                          '"value": "hi"}}'}},
     {"type": "structural_tag", "structural_tag": TAG}),
    ("guided_json", {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, AS_SCHEMA),
    ("guided_json text", {"guided_json": '{"type": "object", "properties": {"a": {"type": '
                                         '"integer"}}, "required": ["a"]}'}, AS_SCHEMA),
    ("guided_regex", {"guided_regex": "\\d+"}, {"type": "regex", "regex": "\\d+"}),
    ("guided_choice", {"guided_choice": ["a", "b"]}, {"type": "choice", "choice": ["a", "b"]}),
    ("guided_grammar", {"guided_grammar": GBNF}, {"type": "grammar", "grammar": GBNF}),
    ("llama.cpp json_schema", {"json_schema": SCHEMA}, AS_SCHEMA),
    ("llama.cpp grammar", {"grammar": GBNF}, {"type": "grammar", "grammar": GBNF}),
    ("text beside another spelling", {"response_format": {"type": "text"},
                                      "guided_choice": ["a"]},
     {"type": "choice", "choice": ["a"]}),
]


@pytest.mark.parametrize("what,extra,internal", SPELLINGS, ids=[s[0] for s in SPELLINGS])
async def test_spelling_reaches_the_tokenizer_as_one_response_format(
        client: httpx.AsyncClient, model: str, tokenizer: FakeTokenizer, what: str,
        extra: dict[str, Any], internal: dict[str, Any] | None) -> None:
    body = {"model": model, "tools": [], "messages": [{"role": "user", "content": "q"}], **extra}
    [req] = await sent(client, tokenizer, "/v1/chat/completions", body)
    assert req.response_format == internal
    [req] = await sent(client, tokenizer, "/v1/completions",
                       {"model": model, "prompt": "q", **extra})
    assert req.response_format == internal
