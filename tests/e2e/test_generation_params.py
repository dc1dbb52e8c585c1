"""Parameters that change generation, honoured end to end with the real SmolLM2 (issue 20).

These need the whole of issue 20's work: the gateway maps each field (this file's branch), the
tokenizer honours its side (echo / prompt-logprob detokenization, include_stop_str_in_output,
regex / choice / grammar constraints, suffix refused on a model without fill-in-the-middle
tokens) and the engine its own (logit_bias, min_tokens, stop_token_ids, prompt_logprobs). Each
test compares with an independent reference: the model's own logits (`LLM.prompt_logits`), the
regular expression, the JSON Schema (jsonschema), or the tokenizer's ids.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def ids_of(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text,
                                     "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


@pytest.mark.slow
def test_echo_logprobs_equal_the_models_prompt_logits(client, http: httpx.Client) -> None:
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs, max_tokens 1):
    one logprob per prompt token, the first null, each the model's log-softmax at the previous
    position (LLM.prompt_logits, the engine as a library, fp32 on CPU)."""
    torch = pytest.importorskip("torch")
    from flotilla.services.engine.llm import LLM

    prompt = ids_of(http, "Question: What is the capital of France?\nAnswer: Paris")
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                  max_tokens=1, temperature=0)
    logprobs = r.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    # the library with the server's default weight format (int4 for this Q4_1 file on CPU)
    llm = LLM("default", quantization="auto")
    reference = torch.log_softmax(torch.as_tensor(llm.prompt_logits(prompt)), -1)
    expected = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    got = logprobs.token_logprobs[1:len(prompt)]
    assert all(math.isclose(g, e, abs_tol=1e-3) for g, e in zip(got, expected, strict=True)), \
        list(zip(got, expected, strict=True))
    assert r.choices[0].text.startswith(
        http.post("/detokenize", json={"model": MODEL, "tokens": prompt}).json()["prompt"])


def test_vllm_prompt_logprobs_are_keyed_by_prompt_ids(http: httpx.Client) -> None:
    prompt = ids_of(http, "The capital of France is")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                           "prompt_logprobs": 2})
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for token_id, entry in zip(prompt[1:], entries[1:], strict=True):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert entry[str(token_id)]["logprob"] <= 0


def test_logit_bias_bans_and_forces(client, http: httpx.Client) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="The capital of France is", max_tokens=1,
                              temperature=0)
    greedy = client.completions.create(**kw).choices[0].text
    [banned] = ids_of(http, greedy)
    again = client.completions.create(**kw, logit_bias={str(banned): -100}).choices[0].text
    assert again != greedy
    forced = ids_of(http, " banana")[0]
    piece = http.post("/detokenize", json={"model": MODEL, "tokens": [forced]}).json()["prompt"]
    forced_text = client.completions.create(**{**kw, "max_tokens": 3},
                                            logit_bias={str(forced): 100}).choices[0].text
    assert forced_text == piece * 3


def test_min_tokens_holds_the_end_back(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=40, extra_body={"min_tokens": 25})
    assert r.usage.completion_tokens >= 25


def test_stop_token_ids_stop(client, http: httpx.Client) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12,
                              temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop_id = ids_of(http, full)[3]
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) < len(full)
    assert full.startswith(r.choices[0].text)


def test_include_stop_str_in_output(client) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16,
                              stop=["Paris"])
    assert "Paris" not in (client.chat.completions.create(**kw).choices[0].message.content or "")
    kept = client.chat.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].message.content or "").endswith("Paris")


@pytest.mark.parametrize("spelling", [
    {"guided_choice": ["yes", "no"]},
    {"structured_outputs": {"choice": ["yes", "no"]}},
])
def test_choice(client, spelling: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=1, max_tokens=8, n=4, messages=[
        {"role": "user", "content": "Is Paris in France?"}], extra_body=spelling)
    assert {c.message.content for c in r.choices} <= {"yes", "no"}


@pytest.mark.parametrize("spelling", [
    {"guided_regex": "[0-9]{3}-[0-9]{4}"},
    {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
])
def test_regex(client, spelling: dict[str, Any]) -> None:
    r = client.completions.create(model=MODEL, prompt="A phone number:", temperature=1,
                                  max_tokens=12, n=4, extra_body=spelling)
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", c.text) for c in r.choices), r.choices


@pytest.mark.parametrize("spelling", [
    {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
    {"guided_grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
])
def test_grammar(client, spelling: dict[str, Any]) -> None:
    r = client.completions.create(model=MODEL, prompt="Is Paris in France?", temperature=1,
                                  max_tokens=12, n=3, extra_body=spelling)
    assert {c.text for c in r.choices} <= {"The answer is yes.", "The answer is no."}


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                           "big": {"type": "boolean"}},
          "required": ["city", "big"]}


@pytest.mark.parametrize("spelling", [
    {"structured_outputs": {"json": SCHEMA}},
    {"guided_json": json.dumps(SCHEMA)},
    {"json_schema": SCHEMA},
    {"response_format": {"type": "json_object", "schema": SCHEMA}},
])
def test_json_schema_spellings(client, spelling: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=MODEL, temperature=1, max_tokens=60, n=3,
                                       messages=[{"role": "user", "content": "Describe Paris."}],
                                       extra_body=spelling)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_suffix_without_fill_in_the_middle_tokens_is_refused(http: httpx.Client) -> None:
    """SmolLM2's tokenizer has no fill-in-the-middle tokens: `suffix` cannot be honoured."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "def f(x):",
                                           "suffix": "    return y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_chat_echo_continues_the_final_message(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, messages=[
            *QUESTION, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "echo": True})
    assert (r.choices[0].message.content or "").startswith("The capital of France is")
