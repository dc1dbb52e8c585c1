"""HTTP handlers of OpenAI's Conversations API: a conversation (metadata) and its items, kept in
the Store (store.py) and used as the history of `/v1/responses` (and, as an extension, chat
completions) requests that name it.

Rules:
- Bodies are validated against the spec; errors use OpenAI's envelope (404 `not_found` for an
  unknown conversation or item).
- Items sent here are kept in the resource form `/v1/responses` gives them (an `id`, a
  `status`, typed content parts); at most 20 per request (the spec's bound).
- Item lists are pages as OpenAI's: `limit` 1-100 (default 20), `order` `asc` or `desc`
  (default), `after` an item id; `include` is accepted (items are returned whole).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from flotilla.libs.common.errors import invalid_request
from flotilla.services.gateway.conversations.store import ConversationStore, item_not_found
from flotilla.services.gateway.request_body import validated_body
from flotilla.services.gateway.responses.items import input_items

if TYPE_CHECKING:
    from flotilla.services.gateway.app import GatewayState

router = APIRouter()


def install(app: FastAPI) -> None:
    """Add the Conversations routes and their store (`app.state.conversations`)."""
    gw: GatewayState = app.state.gateway
    s = gw.settings
    app.state.conversations = ConversationStore(gw.store, s.conversations_ttl_s,
                                                s.conversation_max_items,
                                                s.conversation_max_bytes)
    app.include_router(router)


def _state(request: Request) -> tuple[GatewayState, ConversationStore]:
    return request.app.state.gateway, request.app.state.conversations


def item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else "",
            "last_id": items[-1]["id"] if items else ""}


def page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of `items` (oldest first) for the `limit` / `order` / `after` of `query`."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_request("`order` must be `asc` or `desc`.", param="order")
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid_request("`limit` must be an integer from 1 to 100.", param="limit")
    return item_list(items[:limit], len(items) > limit)


@router.post("/v1/conversations")
async def create_conversation(request: Request) -> Response:
    _, store = _state(request)
    body = await validated_body(request, "createConversation")
    items = input_items(body.get("items") or [])
    return JSONResponse(await store.create(body.get("metadata"), items))


@router.get("/v1/conversations/{conversation_id}")
async def retrieve_conversation(request: Request, conversation_id: str) -> Response:
    _, store = _state(request)
    return JSONResponse((await store.get(conversation_id))["conversation"])


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(request: Request, conversation_id: str) -> Response:
    _, store = _state(request)
    body = await validated_body(request, "updateConversation")
    return JSONResponse(await store.update(conversation_id, body["metadata"]))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(request: Request, conversation_id: str) -> Response:
    _, store = _state(request)
    await store.delete(conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted",
                         "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(request: Request, conversation_id: str) -> Response:
    _, store = _state(request)
    record = await store.get(conversation_id)
    return JSONResponse(page(record["items"], request.query_params))


@router.post("/v1/conversations/{conversation_id}/items")
async def create_items(request: Request, conversation_id: str) -> Response:
    _, store = _state(request)
    body = await validated_body(request, "createConversationItems")
    items = input_items(body["items"])
    await store.append(conversation_id, items, "items")
    return JSONResponse(item_list(items))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def retrieve_item(request: Request, conversation_id: str, item_id: str) -> Response:
    _, store = _state(request)
    record = await store.get(conversation_id)
    for item in record["items"]:
        if item.get("id") == item_id:
            return JSONResponse(item)
    raise item_not_found(item_id)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(request: Request, conversation_id: str, item_id: str) -> Response:
    _, store = _state(request)
    return JSONResponse(await store.delete_item(conversation_id, item_id))
