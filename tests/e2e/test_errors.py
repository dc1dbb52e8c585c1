"""Bad input gets a clear 400/404 in OpenAI's envelope, and the suite keeps serving."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import MODEL

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "temperature": 0}


def _bad(**changes):
    body = dict(GOOD)
    for k, v in changes.items():
        if v is None:
            body.pop(k)
        else:
            body[k] = v
    return body


CASES = [
    ("missing messages", _bad(messages=None), 400, "messages"),
    ("wrong type", _bad(temperature="hot"), 400, "temperature"),
    ("unknown role", _bad(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("n out of range", _bad(n=1000), 400, "n"),
    ("max_tokens zero", _bad(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", _bad(max_tokens=-5), 400, "max_tokens"),
    ("unsupported parameter", _bad(typical_p=0.5), 400, "typical_p"),
    ("unknown model", _bad(model="no-such-model"), 404, "model"),
]


def _check_envelope(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.mark.parametrize("name,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_envelope(http, name, body, status, param) -> None:
    err = _check_envelope(http.post("/v1/chat/completions", json=body), status)
    assert param in (err["param"] or "") or param in err["message"]


def test_malformed_json(http) -> None:
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    err = _check_envelope(r, 400)
    assert err["type"] == "invalid_request_error"


def test_prompt_longer_than_context(http) -> None:
    long = "hello " * 9000  # SmolLM2's context is 8192 tokens
    body = _bad(messages=[{"role": "user", "content": long}])
    for stream in (False, True):
        err = _check_envelope(http.post("/v1/chat/completions", json={**body, "stream": stream}),
                              400)
        assert err["code"] == "context_length_exceeded"


def test_still_serving_after_bad_input(http) -> None:
    for _, body, _, _ in CASES:
        http.post("/v1/chat/completions", json=body)
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
