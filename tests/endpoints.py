"""Where the tests find the real NATS and Redis servers.

Default: the ones on loopback (127.0.0.1:4222, 127.0.0.1:6379). `FLOTILLA_TEST_NATS_URL` and
`FLOTILLA_TEST_REDIS_URL` point a test run at others, e.g. a private nats-server on its own
port so that two test runs on one machine never serve each other's subjects.
"""

from __future__ import annotations

import os

NATS_URL = os.environ.get("FLOTILLA_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("FLOTILLA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
