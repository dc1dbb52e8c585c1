"""Checked guided-decoding specs, remembered: agents send the same tools and schemas with every
turn, and checking 200 tool schemas takes a grammar worker a good part of a second.

Rules:
- Keyed by a digest of exactly what the spec is built from (`spec_key`); the value is the spec,
  or the 400 the inputs deserve (a bad schema stays bad). Nothing else (no 503) is remembered.
- Bounded twice: at most `max_entries` specs and `max_chars` characters of spec text; the least
  recently used go first. 0 entries turns it off.
- Thread-safe: grammar workers store what they finished (even for a caller that stopped
  waiting, so its retry is answered at once); the event loop reads.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import orjson

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.messages import GuidedDecoding

Entry = GuidedDecoding | FlotillaError | None


def spec_key(*parts: Any) -> str:
    """A digest of JSON-able `parts` (dict order does not matter)."""
    try:
        data = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # integers beyond 64 bits
        data = json.dumps(parts, sort_keys=True).encode()
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def _size(entry: Entry) -> int:
    if isinstance(entry, GuidedDecoding):
        return len(entry.value or "") + 64
    return 256


class SpecCache:
    """A bounded LRU of checked specs (see module rules)."""

    def __init__(self, max_entries: int, max_chars: int):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[bool, Entry]:
        """(found, entry); a found entry becomes the most recently used."""
        with self._lock:
            if key not in self._entries:
                return False, None
            self._entries.move_to_end(key)
            return True, self._entries[key]

    def put(self, key: str, entry: Entry) -> None:
        size = _size(entry)
        if self.max_entries == 0 or size > self.max_chars:
            return
        with self._lock:
            if key in self._entries:
                self._chars -= _size(self._entries.pop(key))
            self._entries[key] = entry
            self._chars += size
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                _, old = self._entries.popitem(last=False)
                self._chars -= _size(old)
