"""Token logprobs in the three shapes clients read: chat's `logprobs.content`, the legacy
completions `logprobs` (tokens / token_logprobs / top_logprobs / text_offset) and vLLM's
`prompt_logprobs`.

Rules:
- legacy `text_offset` is each token's character offset in the choice's text; with `echo` the
  prompt's tokens come first, from offset 0, and the prompt's first token has `null` logprob and
  `null` top logprobs (nothing precedes it), as OpenAI's legacy API and vLLM answer.
- vLLM's `prompt_logprobs`: one entry per prompt token, the first `null`; each entry maps token
  ids (as strings, JSON's keys) to `{logprob, rank, decoded_token}` for the prompt's token and
  its most likely alternatives; `rank` is the 1-based place among those alternatives, null for
  a prompt token outside them.
"""

from __future__ import annotations

from typing import Any

from flotilla.libs.common.messages import TextLogprob


def chat_logprobs(items: list[TextLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float, raw: list[int] | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob,
                "bytes": raw if raw is not None else list(token.encode())}

    content = [{**entry(lp.token, lp.logprob, lp.bytes),
                "top_logprobs": [entry(t, v, None) for t, v in lp.top]} for lp in items]
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[TextLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs; `offset` = characters of the choice's text before these tokens."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": [lp.token for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [dict(lp.top) for lp in items],
            "text_offset": offsets}


def echo_logprobs(prompt: list[TextLogprob | None], first_token: str,
                  completion: dict[str, Any] | None = None) -> dict[str, Any]:
    """The legacy logprobs of an echoed prompt (from offset 0), followed by `completion`'s."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    offset = 0
    for lp in prompt:
        token = first_token if lp is None else lp.token
        out["tokens"].append(token)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        out["top_logprobs"].append(None if lp is None else dict(lp.top))
        out["text_offset"].append(offset)
        offset += len(token)
    for key, values in (completion or {}).items():
        out[key].extend(values)
    return out


def _key(token_id: int | None, text: str) -> str:
    # the id, as vLLM keys them; a tokenizer that did not send ids leaves the text as the key
    return str(token_id) if token_id is not None else text


def vllm_prompt_logprobs(prompt: list[TextLogprob | None]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for lp in prompt:
        if lp is None:
            out.append(None)
            continue
        ids = lp.top_ids if len(lp.top_ids) == len(lp.top) else [None] * len(lp.top)
        entry = {_key(tid, text): {"logprob": value, "rank": rank, "decoded_token": text}
                 for rank, (tid, (text, value)) in enumerate(zip(ids, lp.top, strict=True), 1)}
        key = _key(lp.token_id, lp.token)
        rank = entry[key]["rank"] if key in entry else None
        out.append({key: {"logprob": lp.logprob, "rank": rank, "decoded_token": lp.token},
                    **{k: v for k, v in entry.items() if k != key}})
    return out
