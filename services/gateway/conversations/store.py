"""Conversations kept by the server, in the Store (Redis when configured, so every gateway
process sees the same conversation; the in-process store otherwise).

Rules:
- One record per conversation under `conversations:<id>`: the conversation object and its
  items in their resource form (as `/v1/responses` lists them), oldest first. Every write
  renews its TTL (`conversations_ttl_s`): a conversation lives that long after its last change.
- A conversation is bounded: at most `conversation_max_items` items and
  `conversation_max_bytes` bytes of items (as JSON). A change that would pass either is refused
  whole with a 400 naming the field that brought the items (`items`, `conversation`, ...).
- Changes are read-modify-write of the record, serialised per conversation within a process;
  two processes appending to the same conversation at the same instant may lose one of the two
  appends (the last write wins).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from flotilla.libs.common.errors import FlotillaError, invalid_request
from flotilla.libs.common.messages import ErrorInfo
from flotilla.libs.common.store import Store
from flotilla.services.gateway.responses.items import item_id

_KEY = "conversations:"


def not_found(conversation_id: str, param: str | None = None) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=404, type="invalid_request_error", param=param,
                                   code="not_found", message=f"Conversation with id "
                                   f"'{conversation_id}' not found."))


def item_not_found(item: str) -> FlotillaError:
    return FlotillaError(ErrorInfo(status=404, type="invalid_request_error", param="item_id",
                                   code="not_found",
                                   message=f"Item with id '{item}' not found."))


class ConversationStore:
    def __init__(self, store: Store, ttl_s: float, max_items: int, max_bytes: int):
        self.store, self.ttl_s = store, ttl_s
        self.max_items, self.max_bytes = max_items, max_bytes
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def _locked(self, conversation_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(conversation_id, (asyncio.Lock(), 0))
        self._locks[conversation_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[conversation_id]
            if users == 1:
                del self._locks[conversation_id]
            else:
                self._locks[conversation_id] = (lock, users - 1)

    def check(self, items: list[dict[str, Any]], param: str) -> None:
        if len(items) > self.max_items:
            raise invalid_request(f"A conversation holds at most {self.max_items} items on this "
                                  f"server; this change would make it {len(items)}.", param=param)
        size = len(json.dumps(items))
        if size > self.max_bytes:
            raise invalid_request(f"A conversation holds at most {self.max_bytes:,} bytes of "
                                  f"items on this server; this change would make it "
                                  f"{size:,}.", param=param)

    async def _write(self, record: dict[str, Any]) -> None:
        await self.store.set(_KEY + record["conversation"]["id"], json.dumps(record),
                             ttl_s=self.ttl_s)

    async def get(self, conversation_id: str, param: str | None = None) -> dict[str, Any]:
        """The record (`conversation`, `items`); 404 when there is none."""
        raw = await self.store.get(_KEY + conversation_id)
        if raw is None:
            raise not_found(conversation_id, param)
        return json.loads(raw)  # type: ignore[no-any-return]

    async def create(self, metadata: dict[str, str] | None,
                     items: list[dict[str, Any]]) -> dict[str, Any]:
        self.check(items, "items")
        conversation = {"id": item_id("conv"), "object": "conversation",
                        "created_at": int(time.time()), "metadata": metadata or {}}
        await self._write({"conversation": conversation, "items": items})
        return conversation

    async def update(self, conversation_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        async with self._locked(conversation_id):
            record = await self.get(conversation_id)
            record["conversation"]["metadata"] = metadata
            await self._write(record)
        return record["conversation"]  # type: ignore[no-any-return]

    async def delete(self, conversation_id: str) -> None:
        async with self._locked(conversation_id):
            await self.get(conversation_id)
            await self.store.delete(_KEY + conversation_id)

    async def append(self, conversation_id: str, items: list[dict[str, Any]],
                     param: str) -> dict[str, Any]:
        """Add `items` at the end; the record after the change."""
        async with self._locked(conversation_id):
            record = await self.get(conversation_id, param if param == "conversation" else None)
            record["items"] = record["items"] + items
            self.check(record["items"], param)
            await self._write(record)
        return record

    async def delete_item(self, conversation_id: str, item: str) -> dict[str, Any]:
        """Remove one item; the conversation object."""
        async with self._locked(conversation_id):
            record = await self.get(conversation_id)
            kept = [i for i in record["items"] if i.get("id") != item]
            if len(kept) == len(record["items"]):
                raise item_not_found(item)
            record["items"] = kept
            await self._write(record)
        return record["conversation"]  # type: ignore[no-any-return]
