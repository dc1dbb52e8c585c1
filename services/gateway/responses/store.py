"""Stored responses: what `GET /v1/responses/{id}`, `/input_items` and `previous_response_id`
read, in the Store (Redis when configured, so every gateway process sees them and they outlive
a restart; the in-process store otherwise).

Rules:
- One record per response under `responses:<id>`, written with the TTL `responses_ttl_s`: the
  response object, its input items, and the whole conversation up to and including its output
  (`history`), so a `previous_response_id` chain is rebuilt from one read.
- A cancel of a background response run by another gateway process is a flag
  (`responses:cancel:<id>`) that the process running it polls.
"""

from __future__ import annotations

import json
from typing import Any

from flotilla.libs.common.store import Store

_KEY = "responses:"
_CANCEL = "responses:cancel:"
CANCEL_FLAG_TTL_S = 3600.0


class ResponseStore:
    def __init__(self, store: Store, ttl_s: float):
        self.store, self.ttl_s = store, ttl_s

    async def save(self, response: dict[str, Any], input_items: list[dict[str, Any]],
                   history: list[dict[str, Any]]) -> None:
        record = {"response": response, "input_items": input_items, "history": history}
        await self.store.set(_KEY + response["id"], json.dumps(record), ttl_s=self.ttl_s)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        raw = await self.store.get(_KEY + response_id)
        return None if raw is None else json.loads(raw)  # type: ignore[no-any-return]

    async def delete(self, response_id: str) -> bool:
        found = await self.store.get(_KEY + response_id) is not None
        await self.store.delete(_KEY + response_id)
        return found

    async def request_cancel(self, response_id: str) -> None:
        await self.store.set(_CANCEL + response_id, "1", ttl_s=CANCEL_FLAG_TTL_S)

    async def cancel_requested(self, response_id: str) -> bool:
        return await self.store.get(_CANCEL + response_id) is not None
