"""Background responses (`background: true`): runs that outlive their HTTP request.

Rules:
- A background run is a task of the gateway process that accepted it; its response is saved
  (status `in_progress`) before the request is answered, and again when it ends, so any gateway
  sharing the Store can read it meanwhile.
- `cancel(id)` stops a run of this process at once. A run of another process is asked through
  the Store's cancel flag, which each run polls every `poll_s`.
- `stop()` (gateway shutdown) cancels every run still going; each is saved as `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from flotilla.services.gateway.responses.run import ResponseRun
from flotilla.services.gateway.responses.store import ResponseStore

log = logging.getLogger(__name__)


class BackgroundRuns:
    poll_s = 0.5

    def __init__(self, store: ResponseStore):
        self.store = store
        self.runs: dict[str, ResponseRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, run: ResponseRun) -> None:
        response_id = run.req.response_id
        self.runs[response_id] = run
        self._tasks[response_id] = asyncio.ensure_future(self._run(response_id, run))

    async def _run(self, response_id: str, run: ResponseRun) -> None:
        watcher = asyncio.ensure_future(self._watch(response_id, run))
        try:
            await run.prepare()
            await run.collect()
        except Exception as exc:  # a refused first turn: the stored response says why
            log.info("background response %s failed: %s", response_id, exc)
            await run.fail(exc)
        finally:
            watcher.cancel()
            self.runs.pop(response_id, None)
            self._tasks.pop(response_id, None)

    async def _watch(self, response_id: str, run: ResponseRun) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            with contextlib.suppress(Exception):  # the Store briefly unreachable: ask again
                if await self.store.cancel_requested(response_id):
                    run.cancel()
                    return

    async def cancel(self, response_id: str) -> bool:
        """Cancel a run of this process and wait for it to be saved; False if not here."""
        run, task = self.runs.get(response_id), self._tasks.get(response_id)
        if run is None or task is None:
            return False
        run.cancel()
        await asyncio.wait({task}, timeout=5)
        return True

    async def stop(self) -> None:
        for run in list(self.runs.values()):
            run.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks.values()), timeout=5)
