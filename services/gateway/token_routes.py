"""Token endpoints, in vLLM's shapes: `/tokenize` and `/v1/tokenize`, `/detokenize` and
`/v1/detokenize`.

Rules:
- tokenize a `prompt`: the text alone (`add_special_tokens`, default true: BOS where the model
  wants one), no template; tokenize `messages`: rendered exactly as a chat request would be
  (template, tools, `add_generation_prompt` / `continue_final_message` as in chat), then
  tokenized without special tokens unless `add_special_tokens` (vLLM's chat default is false).
- `return_token_strs`: also each id's vocabulary string (`token_strs`, else null).
- detokenize: the ids' text, special tokens kept (an id outside the vocabulary is a 400).
- `model` may be left out while the server serves exactly one model (vLLM makes it optional).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common import subjects
from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import (
    DecodeReply,
    DecodeRequest,
    EncodeReply,
    EncodeRequest,
    RenderReply,
    TextRequest,
)
from flotilla.services.gateway.history import normalize_messages
from flotilla.services.gateway.plan import generation_prompt, new_request_id
from flotilla.services.gateway.request_body import gateway, model_request

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

router = APIRouter()


async def _encode(gw: GatewayState, model: str, text: str, add_special_tokens: bool,
                  token_strs: bool) -> EncodeReply:
    reply = await gw.bus.request(
        subjects.tokenizer_encode(model),
        EncodeRequest(model=model, text=text, add_special_tokens=add_special_tokens,
                      token_strs=token_strs),
        EncodeReply, timeout=gw.settings.request_timeout_s)
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return reply


async def _render(gw: GatewayState, model: str, body: dict[str, Any]) -> RenderReply:
    rid = new_request_id()
    add_generation_prompt, continue_final = generation_prompt(body)
    req = TextRequest(
        request_id=rid, model=model, kind="chat", stream_subject=subjects.text_stream(rid),
        messages=normalize_messages(body["messages"]), tools=await gw.tools.tools_for(body),
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        chat_template_kwargs=body.get("chat_template_kwargs"))
    reply = await gw.bus.request(subjects.tokenizer_render(model), req, RenderReply,
                                 timeout=gw.settings.request_timeout_s)
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return reply


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    body, info = await model_request(request, "tokenize", schema_sizes=True)
    gw = gateway(request)
    want_strs = bool(body.get("return_token_strs"))
    token_strs = None
    if "messages" in body:
        rendered = await _render(gw, info.id, body)
        prompt, tokens, max_len = rendered.prompt, rendered.token_ids, rendered.max_model_len
        if body.get("add_special_tokens") or want_strs:
            encoded = await _encode(gw, info.id, prompt, bool(body.get("add_special_tokens")),
                                    want_strs)
            tokens, token_strs = encoded.token_ids, encoded.token_strs
    else:
        prompt = body["prompt"]
        add = body.get("add_special_tokens")
        encoded = await _encode(gw, info.id, prompt, add is None or bool(add), want_strs)
        tokens, token_strs, max_len = encoded.token_ids, encoded.token_strs, encoded.max_model_len
    return JSONResponse({"model": info.id, "prompt": prompt, "tokens": tokens,
                         "count": len(tokens), "max_model_len": max_len or info.max_model_len or 0,
                         "token_strs": token_strs})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    body, info = await model_request(request, "detokenize")
    gw = gateway(request)
    reply = await gw.bus.request(subjects.tokenizer_decode(info.id),
                                 DecodeRequest(model=info.id, token_ids=body["tokens"]),
                                 DecodeReply, timeout=gw.settings.request_timeout_s)
    if reply.error is not None:
        raise FlotillaError(reply.error)
    return JSONResponse({"model": info.id, "prompt": reply.text})
