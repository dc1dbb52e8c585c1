"""The chat web UI of `flotilla up --ui` in headless Chromium, against the real suite and the
default model (SmolLM2): the page loads fast with no console error and no other origin, an
answer streams in, Stop aborts the engine's request, history survives a reload, a bad request's
error envelope is shown; reasoning and hostile Markdown come from a stubbed stream (SmolLM2
neither reasons nor writes HTML on request). Skips without Playwright or Chromium."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from flotilla.libs.common import subjects
from flotilla.libs.common.bus import Bus
from flotilla.libs.common.messages import HealthReply, HealthRequest
from tests.e2e.conftest import MODEL, SuiteHandle
from tests.ui.conftest import CHROMIUM_ARGS, WATCH_STREAM, chromium_path

pytestmark = pytest.mark.timeout(240)


def engine_stats(suite) -> dict:
    """The engine's health detail (its stats), asked on a thread of its own: Playwright's sync
    API keeps an event loop running in this one."""

    async def ask() -> dict:
        bus = await Bus.connect(suite.nats_url, "e2e-ui-test", security=suite.nats_security)
        try:
            reply = await bus.request(subjects.health("engine"), HealthRequest(), HealthReply, 5)
            return reply.detail
        finally:
            await bus.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


def stub_stream(route: Any) -> None:
    """One streamed answer with reasoning and hostile Markdown, in OpenAI's chunk format."""
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Thinking it over. "},
              {"reasoning_content": "Done thinking."},
              {"content": "Look: <img src=x onerror=\"window.__pwned=1\"> "},
              {"content": "[click](javascript:window.__pwned=2)"}]
    chunks = [{"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
               "model": MODEL, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
              for d in deltas]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)


def test_chat_ui_against_the_real_suite(suite: SuiteHandle, browser: Any) -> None:
    origin = suite.root_url
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(origin + "/")
        page.locator("#model option").first.wait_for(state="attached")
        load_ms = page.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd")
        assert 0 < load_ms < 1000, f"the page took {load_ms:.0f} ms to load"
        assert page.locator("#model option").all_inner_texts() == [MODEL]

        page.click("#open-settings")
        page.fill("#set-temperature", "0")
        page.fill("#set-max-tokens", "400")
        page.press("#set-max-tokens", "Tab")
        page.click("#close-settings")

        # an answer grows in over several DOM updates; Stop aborts it in the engine
        aborted_before = engine_stats(suite)["requests_aborted"]
        page.evaluate(WATCH_STREAM)
        page.fill("#input", "Write a long story about a cat.")
        page.press("#input", "Enter")
        for _ in range(600):
            if len(page.evaluate("window.__lengths")) >= 4:
                break
            page.wait_for_timeout(50)
        assert len(page.evaluate("window.__lengths")) >= 4, "the answer did not stream in"
        page.click("#stop")
        page.locator("#send").wait_for(state="visible")
        answer = page.locator("article.msg.assistant").first
        assert "stopped" in answer.locator(".msg-meta").inner_text()
        stats: dict = {}
        for _ in range(50):
            stats = engine_stats(suite)
            if stats["requests_aborted"] > aborted_before and not stats["active_request_ids"]:
                break
            time.sleep(0.2)
        assert stats["requests_aborted"] > aborted_before, stats
        assert not stats["active_request_ids"], stats

        # a second conversation with a short answer; both survive a reload
        page.click("#new-chat")
        page.fill("#input", "What is the capital of France? Answer in one word.")
        page.press("#input", "Enter")
        page.locator("#send").wait_for(state="visible", timeout=120_000)
        page.locator("article.msg.assistant .msg-meta").wait_for()
        assert "Paris" in page.locator("article.msg.assistant .msg-body").inner_text()
        page.reload()
        page.locator(".conv-title").nth(1).wait_for()
        titles = page.locator(".conv-title").all_inner_texts()
        assert titles == ["What is the capital of France? Answer in one wor",
                          "Write a long story about a cat."], titles
        page.locator(".conv-title").nth(1).click()
        assert page.locator("article.msg.user .msg-body").inner_text() == \
            "Write a long story about a cat."

        assert not errors, errors
        # the gateway's error envelope for a bad request, shown as it came (the browser logs
        # the 400 itself as a console error: the one expected)
        page.click("#open-settings")
        page.fill("#set-temperature", "9")
        page.press("#set-temperature", "Tab")
        page.click("#close-settings")
        page.click("#new-chat")
        page.fill("#input", "hi")
        page.press("#input", "Enter")
        error = page.locator("article.msg.assistant .msg-error")
        error.wait_for()
        assert error.inner_text().startswith("400 invalid_request_error (param temperature)")

        # reasoning (collapsed) and hostile Markdown from a stubbed stream: rendered inert
        page.route("**/v1/chat/completions", stub_stream)
        page.click("article.msg.assistant [data-action=regenerate]")
        page.locator("article.msg.assistant .msg-meta").wait_for()
        details = page.locator("article.msg.assistant details.reasoning")
        assert details.get_attribute("open") is None
        assert page.evaluate("window.__pwned") is None
        body = page.locator("article.msg.assistant .msg-body")
        assert body.locator("img, [onerror]").count() == 0
        assert body.locator("a").get_attribute("href") is None
        page.unroute("**/v1/chat/completions")

        assert errors == ["Failed to load resource: the server responded with a status of 400 "
                          "(Bad Request)"], errors
        assert all(u.startswith(origin + "/") for u in requests), requests
    finally:
        context.close()


def test_ui_files_come_with_their_csp(http) -> None:
    page = http.get("/")
    assert page.status_code == 200
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert http.get("/ui/app.js").status_code == 200

