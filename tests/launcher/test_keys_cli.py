"""`flotilla keys create|list|revoke` against the real Redis: the key is printed once and only
its hash is stored; `list` never shows it; `revoke` by id or by the key itself; no Redis is a
clear error."""

from __future__ import annotations

import asyncio

import pytest
import redis

from flotilla.libs.common.store import RedisStore
from flotilla.services.gateway.api_keys import KeyRecord, KeyRing, key_hash
from flotilla.services.launcher.cli import main
from tests.endpoints import REDIS_URL


def _lookup(key: str) -> KeyRecord | None:
    async def look() -> KeyRecord | None:
        store = RedisStore(REDIS_URL)
        try:
            return await KeyRing(store, [], True, KeyRecord(id="")).lookup(key)
        finally:
            await store.close()

    return asyncio.run(look())


def test_create_list_revoke(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--redis-url", REDIS_URL, "--name", "cli-test",
                 "--models", "m1,m2", "--rpm", "5", "--tpm", "900", "--max-concurrent", "2"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith("flt-") and len(key) > 40 and "\n" not in key
    record = _lookup(key)
    assert record is not None and (record.name, record.models, record.rpm, record.tpm,
                                   record.max_concurrent) == ("cli-test", ["m1", "m2"], 5, 900, 2)
    assert record.id in err and key not in err
    raw = redis.Redis.from_url(REDIS_URL)
    assert raw.get(f"flotilla:apikey:{key_hash(key)}") is not None
    raw.close()

    assert main(["keys", "list", "--redis-url", REDIS_URL]) == 0
    out, _ = capsys.readouterr()
    line = next(li for li in out.splitlines() if li.startswith(record.id))
    assert "cli-test" in line and "models=m1,m2" in line and "rpm=5" in line
    assert key not in out

    assert main(["keys", "revoke", "--redis-url", REDIS_URL, key]) == 0  # by the key itself
    assert _lookup(key) is None
    assert main(["keys", "revoke", "--redis-url", REDIS_URL, record.id]) == 1  # gone already
    assert "no key" in capsys.readouterr().err


def test_keys_need_redis(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("FLOTILLA_REDIS_URL", raising=False)
    assert main(["keys", "list"]) == 1
    assert "FLOTILLA_REDIS_URL" in capsys.readouterr().err
