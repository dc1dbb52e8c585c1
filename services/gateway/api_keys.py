"""API keys: what a key may do (`KeyRecord`), kept only as the SHA-256 of the key.

Rules:
- A key is never stored: `flotilla keys create` makes a random 256-bit key (`flt-...`), prints it
  once, and stores its record under `apikey:<sha256 hex>` in the shared store (Redis: every
  gateway replica sees it at once). A key this long cannot be found from its hash, so a plain
  SHA-256 suffices (no salt or slow hash: those guard short, guessable passwords).
- Keys set in settings (`FLOTILLA_API_KEYS`, `--api-key`, `api_key_file`) live in memory only,
  hashed when read; their limits are the `key_*` settings. They are revoked by removing them
  from the settings.
- `KeyRing.lookup(key)` is the gateway's check: the settings' keys first, then the store. A
  revoked (deleted) key is simply not found. A store that cannot be reached raises
  `StoreUnavailable` (503), never "wrong key".
- A record's `models` (None = all) is its allowlist; `rpm`, `tpm`, `max_concurrent` (None =
  unlimited) are its limits (rate_limits.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path

from pydantic import BaseModel

from flotilla.libs.common.settings import GatewaySettings
from flotilla.libs.common.store import Store

PREFIX = "apikey:"
KEY_PREFIX = "flt-"


class KeyRecord(BaseModel):
    id: str  # shown by `keys list`, used by `keys revoke`; not secret
    name: str = ""
    models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    created: int = 0

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def read_key_file(path: Path) -> list[str]:
    """The hashes of the keys in a key file (see `api_key_file`)."""
    hashes = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if entry.startswith("sha256:"):
            digest = entry.removeprefix("sha256:").lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{path}: {entry[:20]}... is not a SHA-256 in hex")
            hashes.append(digest)
        else:
            hashes.append(key_hash(entry))
    return hashes


class KeyRing:
    """The keys one gateway accepts: from its settings and from the shared store."""

    def __init__(self, store: Store, configured: list[str], required: bool,
                 template: KeyRecord):
        self.store = store
        self.required = required or bool(configured)
        self._configured = {
            digest: template.model_copy(update={"id": "cfg_" + digest[:12]})
            for digest in configured}

    @classmethod
    def from_settings(cls, settings: GatewaySettings, store: Store) -> KeyRing:
        hashes = []
        if settings.api_keys is not None:
            hashes += [key_hash(k.strip()) for k in
                       settings.api_keys.get_secret_value().split(",") if k.strip()]
        if settings.api_key_file is not None:
            hashes += read_key_file(settings.api_key_file)
        template = KeyRecord(id="", name="settings", rpm=settings.key_rpm, tpm=settings.key_tpm,
                             max_concurrent=settings.key_max_concurrent)
        return cls(store, hashes, settings.require_api_key, template)

    async def lookup(self, key: str) -> KeyRecord | None:
        digest = key_hash(key)
        for known, record in self._configured.items():
            if hmac.compare_digest(known, digest):
                return record
        raw = await self.store.get(PREFIX + digest)
        return None if raw is None else KeyRecord.model_validate_json(raw)


async def create_key(store: Store, name: str = "", models: list[str] | None = None,
                     rpm: int | None = None, tpm: int | None = None,
                     max_concurrent: int | None = None) -> tuple[str, KeyRecord]:
    """A new key (returned once, never stored) and its stored record."""
    key = new_key()
    record = KeyRecord(id="key_" + secrets.token_hex(6), name=name, models=models, rpm=rpm,
                       tpm=tpm, max_concurrent=max_concurrent, created=int(time.time()))
    await store.set(PREFIX + key_hash(key), record.model_dump_json())
    return key, record


async def list_keys(store: Store) -> list[KeyRecord]:
    records = [KeyRecord.model_validate_json(v) for v in (await store.scan(PREFIX)).values()]
    return sorted(records, key=lambda r: (r.created, r.id))


async def revoke_key(store: Store, key_id: str) -> str | None:
    """Delete the key whose id (or the key itself) is `key_id`; the id deleted, if any."""
    for name, raw in (await store.scan(PREFIX)).items():
        record = KeyRecord.model_validate_json(raw)
        if record.id == key_id or name == PREFIX + key_hash(key_id):
            await store.delete(name)
            return record.id
    return None
