"""Fixtures for the chat UI's tests: a real gateway with the UI on (uvicorn in this process,
the real NATS), two fake tokenizers (two models for the picker), and headless Chromium
(Debian's package) driven by Playwright's async API on the same event loop.

The browser tests skip, with the reason, where Playwright or Chromium is missing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from flotilla.libs.common.bus import Bus
from flotilla.services.gateway.service import GatewayService
from tests.endpoints import NATS_URL
from tests.gateway.conftest import gateway_settings
from tests.ui.fakes import UiFakeTokenizer

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    return None


@pytest.fixture(scope="package")
async def bus() -> AsyncIterator[Bus]:
    b = await Bus.connect(NATS_URL, "test-ui")
    yield b
    await b.close()


@pytest.fixture(scope="package")
async def models(bus: Bus) -> AsyncIterator[list[UiFakeTokenizer]]:
    tag = uuid.uuid4().hex[:6]
    fakes = [UiFakeTokenizer(bus, f"ui-{tag}-alpha"), UiFakeTokenizer(bus, f"ui-{tag}-beta")]
    for fake in fakes:
        await fake.start()
    yield fakes
    for fake in fakes:
        await fake.stop()


@pytest.fixture(scope="package")
async def gateway(bus: Bus, models: list[UiFakeTokenizer]) -> AsyncIterator[GatewayService]:
    # A browser shares this machine's cores with the test's event loop: liveness limits with room
    service = GatewayService(gateway_settings(ui=True, heartbeat_timeout_s=5.0,
                                              request_timeout_s=10.0), bus)
    await service.start()
    for _ in range(100):
        if all([await service.state.registry.get(m.model) for m in models]):
            break
        await asyncio.sleep(0.05)
    yield service
    await service.stop()


@pytest.fixture(scope="package")
async def browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        await b.close()


class PageLog:
    """What a page did that a test may forbid: console errors, dialogs, requests elsewhere."""

    def __init__(self, origin: str):
        self.origin = origin
        self.console_errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[Any] = []

    def foreign_requests(self) -> list[str]:
        mine = (self.origin + "/", "blob:", "data:")
        return [r.url for r in self.requests if not r.url.startswith(mine)]


@pytest.fixture
async def page(browser: Any, gateway: GatewayService) -> AsyncIterator[Any]:
    """A fresh browser context (empty storage) on the UI, with its PageLog as `page.log`."""
    context = await browser.new_context(viewport={"width": 1280, "height": 800},
                                        accept_downloads=True)
    await context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.url)
    pg = await context.new_page()
    log = PageLog(gateway.url)
    pg.on("console", lambda m: log.console_errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: log.console_errors.append(f"pageerror: {e}"))
    pg.on("request", lambda r: log.requests.append(r))

    async def on_dialog(dialog: Any) -> None:
        log.dialogs.append(dialog.message)
        await dialog.dismiss()

    pg.on("dialog", on_dialog)
    pg.log = log
    await pg.goto(gateway.url + "/")
    await models_listed(pg)
    yield pg
    await context.close()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests save their screenshots: FLOTILLA_TEST_SCREENSHOTS, else a temp dir."""
    chosen = os.environ.get("FLOTILLA_TEST_SCREENSHOTS")
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return Path(chosen)
    return tmp_path_factory.mktemp("ui-screenshots")


WATCH_STREAM = """() => {
  window.__lengths = [];
  const root = document.getElementById('messages');
  new MutationObserver(() => {
    const body = root.querySelector('article.streaming .msg-body');
    const n = body ? body.textContent.length : -1;
    if (n > 0 && window.__lengths[window.__lengths.length - 1] !== n) window.__lengths.push(n);
  }).observe(root, {childList: true, subtree: true, characterData: true});
}"""


async def models_listed(page: Any) -> None:
    """Waits until the model picker has both fake models. (Not wait_for_function: Playwright
    evaluates its predicate with eval, which the page's CSP rightly refuses.)"""
    await page.locator("#model option").nth(1).wait_for(state="attached")


async def send(page: Any, text: str) -> Any:
    """Types `text` into the composer, presses Enter, and returns the new answer's article.
    `window.__lengths` collects the lengths the streaming answer's text had, in order."""
    await page.evaluate(WATCH_STREAM)
    count = await page.locator("article.msg.assistant").count()
    await page.fill("#input", text)
    await page.press("#input", "Enter")
    answer = page.locator("article.msg.assistant").nth(count)
    await answer.wait_for()
    return answer


async def finished(page: Any) -> None:
    """Waits until no answer is streaming (the Send button is back)."""
    await page.locator("#send").wait_for(state="visible")
