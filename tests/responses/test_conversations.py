"""/v1/conversations through the official `openai` SDK against a real gateway (fake tokenizer):
the conversation objects and items validate against OpenAI's own spec, a conversation is the
history of the responses that name it (checked in what the tokenizer received), two gateways
sharing Redis see the same conversation, and a conversation is bounded."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError

from flotilla.libs.common.bus import Bus
from flotilla.services.gateway.service import GatewayService
from tests.endpoints import REDIS_URL
from tests.gateway.conftest import gateway_settings
from tests.gateway.fakes import FakeTokenizer
from tests.gateway.schemas import validate_openai

HELLO = "Hello world !"  # what the fake tokenizer answers


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


async def test_sdk_round_trip(oai: AsyncOpenAI, client: httpx.AsyncClient) -> None:
    conv = await oai.conversations.create(metadata={"topic": "demo"},
                                          items=[user("first"), user("second")])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    raw = (await client.get(f"/v1/conversations/{conv.id}")).json()
    validate_openai("ConversationResource", raw)
    assert (await oai.conversations.retrieve(conv.id)).created_at == conv.created_at

    updated = await oai.conversations.update(conv.id, metadata={"topic": "new"})
    assert updated.metadata == {"topic": "new"}
    assert (await oai.conversations.retrieve(conv.id)).metadata == {"topic": "new"}

    added = await oai.conversations.items.create(conv.id, items=[user("third")])
    assert [i.content[0].text for i in added.data] == ["third"]  # type: ignore[union-attr]

    page = await oai.conversations.items.list(conv.id, order="asc")
    texts = [i.content[0].text for i in page.data]  # type: ignore[union-attr]
    assert texts == ["first", "second", "third"]
    raw_page = (await client.get(f"/v1/conversations/{conv.id}/items")).json()
    validate_openai("ConversationItemList", raw_page)
    assert [i["content"][0]["text"] for i in raw_page["data"]] == ["third", "second", "first"]

    two = (await client.get(f"/v1/conversations/{conv.id}/items",
                            params={"order": "asc", "limit": 2})).json()
    assert len(two["data"]) == 2 and two["has_more"] is True
    rest = (await client.get(f"/v1/conversations/{conv.id}/items",
                             params={"order": "asc", "after": two["last_id"]})).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["third"]
    assert rest["has_more"] is False

    first_id = page.data[0].id
    item = await oai.conversations.items.retrieve(first_id, conversation_id=conv.id)
    assert item.id == first_id
    validate_openai("ConversationItem",
                    (await client.get(f"/v1/conversations/{conv.id}/items/{first_id}")).json())
    after_delete = await oai.conversations.items.delete(first_id, conversation_id=conv.id)
    assert after_delete.id == conv.id
    validate_openai("ConversationResource",
                    (await client.delete(f"/v1/conversations/{conv.id}/items/"
                                         f"{page.data[1].id}")).json())
    left = await oai.conversations.items.list(conv.id)
    assert [i.content[0].text for i in left.data] == ["third"]  # type: ignore[union-attr]
    with pytest.raises(NotFoundError):
        await oai.conversations.items.retrieve(first_id, conversation_id=conv.id)

    deleted = await oai.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(NotFoundError):
        await oai.conversations.retrieve(conv.id)


async def test_unknown_conversation_is_404(client: httpx.AsyncClient, model: str) -> None:
    for method, path in [("GET", "/v1/conversations/conv_nope"),
                         ("DELETE", "/v1/conversations/conv_nope"),
                         ("GET", "/v1/conversations/conv_nope/items")]:
        r = await client.request(method, path)
        assert r.status_code == 404
        validate_openai("ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "not_found"
    r = await client.post("/v1/responses", json={"model": model, "input": "hi",
                                                 "conversation": "conv_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation"


async def test_responses_in_a_conversation(oai: AsyncOpenAI, client: httpx.AsyncClient,
                                           model: str, tokenizer: FakeTokenizer) -> None:
    conv = await oai.conversations.create()
    asked = ["one", "two", "three"]
    for turn, text in enumerate(asked):
        if turn == 1:  # streamed turns are kept too
            async with oai.responses.stream(model=model, input=text,
                                            conversation=conv.id) as stream:
                r = await stream.get_final_response()
        else:
            r = await oai.responses.create(model=model, input=text,
                                           conversation={"id": conv.id})
        assert r.output_text == HELLO
        assert r.conversation is not None and r.conversation.id == conv.id
        expected = []
        for earlier in asked[:turn]:
            expected += [{"role": "user", "content": earlier},
                         {"role": "assistant", "content": HELLO}]
        expected.append({"role": "user", "content": text})
        sent = [{k: m[k] for k in ("role", "content")} for m in tokenizer.requests[-1].messages]
        assert sent == expected
    validate_openai("Response", (await client.get(f"/v1/responses/{r.id}")).json())
    items = (await client.get(f"/v1/conversations/{conv.id}/items",
                              params={"order": "asc"})).json()
    validate_openai("ConversationItemList", items)
    assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [
        (role, text) for a in asked for role, text in (("user", a), ("assistant", HELLO))]

    with pytest.raises(BadRequestError) as err:
        await oai.responses.create(model=model, input="x", conversation=conv.id,
                                   previous_response_id=r.id)
    assert err.value.body["param"] == "conversation"  # type: ignore[index]


@pytest.fixture
async def shared_pair(bus: Bus, tokenizer: FakeTokenizer
                      ) -> AsyncIterator[tuple[GatewayService, GatewayService]]:
    settings = gateway_settings(redis_url=REDIS_URL, conversation_max_items=4,
                                conversation_max_bytes=2048)
    services = [GatewayService(settings, bus), GatewayService(settings, bus)]
    for s in services:
        await s.start()
    yield services[0], services[1]
    for s in services:
        await s.stop()


async def test_two_gateways_share_a_bounded_conversation(
        shared_pair: tuple[GatewayService, GatewayService]) -> None:
    a, b = shared_pair
    async with httpx.AsyncClient(base_url=a.url, timeout=15) as ca, \
            httpx.AsyncClient(base_url=b.url, timeout=15) as cb:
        conv = (await ca.post("/v1/conversations", json={"items": [user("a")]})).json()
        path = f"/v1/conversations/{conv['id']}"
        assert (await cb.get(path)).json() == conv
        r = await cb.post(path + "/items", json={"items": [user("b"), user("c")]})
        assert r.status_code == 200
        texts = [i["content"][0]["text"] for i in (await ca.get(path + "/items")).json()["data"]]
        assert texts == ["c", "b", "a"]

        too_many = await ca.post(path + "/items", json={"items": [user("d"), user("e")]})
        assert too_many.status_code == 400
        validate_openai("ErrorResponse", too_many.json())
        assert too_many.json()["error"]["param"] == "items"
        assert len((await cb.get(path + "/items")).json()["data"]) == 3  # refused whole

        too_big = await cb.post("/v1/conversations", json={"items": [user("x" * 3000)]})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "items"

        assert (await cb.delete(path)).status_code == 200
        assert (await ca.get(path)).status_code == 404


async def test_conversation_full_refuses_a_response(client: httpx.AsyncClient, model: str,
                                                    gateway: GatewayService) -> None:
    store = gateway.app.state.conversations
    limit = store.max_items
    conv = (await client.post("/v1/conversations", json={})).json()
    await store.append(conv["id"], [{"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                                     "role": "user", "status": "completed",
                                     "content": [{"type": "input_text", "text": "x"}]}
                                    for _ in range(limit)], "items")
    r = await client.post("/v1/responses", json={"model": model, "input": "hi",
                                                 "conversation": conv["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"


async def test_chat_completions_in_a_conversation(oai: AsyncOpenAI, client: httpx.AsyncClient,
                                                  model: str, tokenizer: FakeTokenizer) -> None:
    conv = await oai.conversations.create(items=[user("earlier")])
    first = await oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "one"}],
        extra_body={"conversation": conv.id})
    assert first.choices[0].message.content == HELLO
    assert [(m["role"], m["content"]) for m in tokenizer.requests[-1].messages] == [
        ("user", "earlier"), ("user", "one")]
    stream = await oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "two"}]}],
        stream=True, extra_body={"conversation": conv.id})
    assert "".join([c.choices[0].delta.content or "" async for c in stream
                    if c.choices]) == HELLO
    assert [(m["role"], m["content"]) for m in tokenizer.requests[-1].messages] == [
        ("user", "earlier"), ("user", "one"), ("assistant", HELLO), ("user", "two")]
    items = (await client.get(f"/v1/conversations/{conv.id}/items",
                              params={"order": "asc"})).json()
    validate_openai("ConversationItemList", items)
    assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [
        ("user", "earlier"), ("user", "one"), ("assistant", HELLO), ("user", "two"),
        ("assistant", HELLO)]

    for extra, param in [({"n": 2}, "n"), ({"conversation": "conv_nope"}, "conversation")]:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "x"}],
            "conversation": conv.id, **extra})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param
