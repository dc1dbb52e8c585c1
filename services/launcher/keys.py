"""`flotilla keys create|list|revoke`: the API keys every gateway sharing a Redis accepts.

    flotilla keys create [--name NAME] [--models A,B] [--rpm N] [--tpm N] [--max-concurrent N]
    flotilla keys list
    flotilla keys revoke KEY_ID
    (each takes --redis-url URL; default FLOTILLA_REDIS_URL)

Rules:
- The keys live in Redis (FLOTILLA_REDIS_URL or --redis-url), as the gateways read them
  (services/gateway/api_keys.py): only each key's SHA-256 and its record. Without Redis there
  is no shared place to put them: the command says so and exits 1 (use FLOTILLA_API_KEYS).
- `create` prints the key once, on stdout alone (`KEY=$(flotilla keys create)` works), and its
  id and limits on stderr; the key cannot be shown again. `revoke` takes the id (or the key).
- Gateways run with `FLOTILLA_REQUIRE_API_KEY=1` (or some key in their settings) to require
  keys; a revoked key is refused by every gateway from its next request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from flotilla.libs.common.errors import FlotillaError
from flotilla.libs.common.settings import LauncherSettings
from flotilla.libs.common.store import RedisStore
from flotilla.services.gateway.api_keys import KeyRecord, create_key, list_keys, revoke_key


def add_arguments(parser: argparse.ArgumentParser, settings: LauncherSettings) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=settings.redis_url,
                        help="the Redis the gateways share (default: FLOTILLA_REDIS_URL)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", parents=[common],
                                help="make a key and print it (once)")
    create.add_argument("--name", default="", help="a label shown by `list`")
    create.add_argument("--models", default=None, metavar="A,B",
                        help="models the key may use, comma-separated (default: all); others "
                             "answer 404 model_not_found, as OpenAI does for a model a key "
                             "cannot see")
    create.add_argument("--rpm", type=_positive, default=None,
                        help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=_positive, default=None,
                        help="tokens per minute, prompt + generated (default: unlimited)")
    create.add_argument("--max-concurrent", type=_positive, default=None, metavar="N",
                        help="requests in flight at once (default: unlimited)")
    actions.add_parser("list", parents=[common],
                       help="show every key's id, name, models and limits")
    revoke = actions.add_parser("revoke", parents=[common],
                                help="delete a key: refused from its next request")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the id `list` shows (or the key)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _describe(record: KeyRecord) -> str:
    def limit(value: int | None) -> str:
        return "-" if value is None else str(value)

    models = ",".join(record.models) if record.models is not None else "*"
    return (f"{record.id:<18} {record.name or '-':<16} models={models} rpm={limit(record.rpm)} "
            f"tpm={limit(record.tpm)} concurrent={limit(record.max_concurrent)}")


async def _run(args: argparse.Namespace) -> int:
    store = RedisStore(args.redis_url)
    try:
        if args.action == "create":
            models = ([m.strip() for m in args.models.split(",") if m.strip()]
                      if args.models is not None else None)
            key, record = await create_key(store, args.name, models, args.rpm, args.tpm,
                                           args.max_concurrent)
            print(key, flush=True)
            print(f"created {_describe(record)}\n(the key is shown only now: keep it)",
                  file=sys.stderr)
        elif args.action == "list":
            records = await list_keys(store)
            for record in records:
                print(_describe(record))
            if not records:
                print("no keys", file=sys.stderr)
        elif (revoked := await revoke_key(store, args.key_id)) is None:
            print(f"flotilla: no key {args.key_id!r}", file=sys.stderr)
            return 1
        else:
            print(f"revoked {revoked}", file=sys.stderr)
        return 0
    finally:
        await store.close()


def run(args: argparse.Namespace) -> int:
    if not args.redis_url:
        print("flotilla: keys live in Redis, shared by every gateway: set FLOTILLA_REDIS_URL "
              "or --redis-url (without Redis, give keys with --api-key / FLOTILLA_API_KEYS)",
              file=sys.stderr)
        return 1
    try:
        return asyncio.run(_run(args))
    except FlotillaError as exc:  # Redis unreachable
        print(f"flotilla: {exc}", file=sys.stderr)
        return 1
