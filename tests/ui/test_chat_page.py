"""The chat page in headless Chromium against a real gateway (fake tokenizers): streaming
Markdown, code highlighting and copy, reasoning, tool calls, untrusted output, stop, errors."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ui.conftest import finished, send
from tests.ui.fakes import CODE, REASONING

pytestmark = pytest.mark.timeout(60)


async def test_answer_streams_as_markdown_with_highlighted_code_and_copy(page: Any,
                                                                        screenshots) -> None:
    answer = await send(page, "markdown")
    await finished(page)
    lengths = await page.evaluate("window.__lengths")
    # (not monotonic: "**th" shrinks when "**the**" turns bold)
    assert len(set(lengths)) >= 3, f"the answer did not grow in over 3 updates: {lengths}"
    body = answer.locator(".msg-body")
    assert await body.locator("h2").inner_text() == "Greeting"
    assert await body.locator("li").count() == 2
    code = body.locator(".code-block code.language-python")
    assert await code.inner_text() == CODE.rstrip("\n") or await code.inner_text() == CODE
    assert await code.locator(".hljs-keyword").first.inner_text() == "def"
    await body.locator(".copy-code").click()
    clip = await page.evaluate("navigator.clipboard.readText()")
    assert clip.rstrip("\n") == CODE.rstrip("\n")
    assert await body.locator(".copy-code").inner_text() == "Copied"
    meta = await answer.locator(".msg-meta").inner_text()
    assert "TTFT" in meta and "tok/s" in meta and "7 prompt" in meta and "finish: stop" in meta
    await page.screenshot(path=str(screenshots / "desktop-light-answer.png"))
    assert not page.log.console_errors and not page.log.foreign_requests()


async def test_reasoning_streams_into_a_collapsed_block(page: Any) -> None:
    answer = await send(page, "think")
    details = answer.locator("details.reasoning")
    await details.wait_for()
    assert await details.get_attribute("open") is None, "reasoning must start collapsed"
    assert await details.locator("summary").inner_text() == "Thinking…"
    await finished(page)
    assert await answer.locator(".msg-body").inner_text() == "The answer is 42."
    assert await details.get_attribute("open") is None
    await details.locator("summary").click()
    assert await details.locator(".md").inner_text() == "".join(REASONING).strip()


async def test_tool_calls_are_shown(page: Any) -> None:
    answer = await send(page, "tools")
    await finished(page)
    call = answer.locator(".tool-call")
    assert "get_weather" in await call.locator("summary").inner_text()
    assert await call.locator("pre").inner_text() == '{"city": "Paris"}'
    assert "finish: tool_calls" in await answer.locator(".msg-meta").inner_text()


async def test_untrusted_output_is_rendered_inert(page: Any) -> None:
    answer = await send(page, "xss")
    await finished(page)
    await page.wait_for_timeout(300)  # time for an onerror/onload to have fired
    assert await page.evaluate("window.__pwned") is None
    assert not page.log.dialogs
    body = answer.locator(".msg-body")
    assert await body.locator("script, [onerror], [onload], svg, iframe").count() == 0
    text = await body.inner_text()
    assert "<img src=x" in text  # raw HTML is shown as text
    for link in await body.locator("a").all():
        href = await link.get_attribute("href")
        assert href is None or href.startswith("https://"), href
        if href is not None:
            assert await link.get_attribute("target") == "_blank"
            assert await link.get_attribute("rel") == "noopener noreferrer"
    # the remote image became a link: nothing was fetched from another origin
    assert await body.locator("img").count() == 0
    assert not page.log.foreign_requests(), page.log.foreign_requests()
    await body.locator("a", has_text="click me").click()  # its href is gone: nothing happens
    assert await page.evaluate("window.__pwned") is None


async def test_stop_button_cancels_generation_on_the_server(page: Any, models) -> None:
    answer = await send(page, "slow")
    await answer.locator(".msg-body", has_text="w2").wait_for()
    rid = models[0].requests[-1].request_id
    await page.click("#stop")
    await finished(page)
    assert "stopped" in await answer.locator(".msg-meta").inner_text()
    partial = await answer.locator(".msg-body").inner_text()
    for _ in range(40):
        if models[0].cancelled(rid):
            break
        await page.wait_for_timeout(50)
    assert models[0].cancelled(rid), "closing the stream must cancel the request on the server"
    await page.wait_for_timeout(400)
    assert await answer.locator(".msg-body").inner_text() == partial  # nothing more arrived


async def test_escape_stops_and_enter_shift_enter(page: Any, models) -> None:
    await page.fill("#input", "line one")
    await page.press("#input", "Shift+Enter")
    await page.keyboard.type("line two")
    assert await page.input_value("#input") == "line one\nline two"
    assert await page.locator("article.msg").count() == 0  # Shift+Enter did not send
    await page.fill("#input", "slow")
    await page.press("#input", "Enter")
    answer = page.locator("article.msg.assistant").first
    await answer.locator(".msg-body", has_text="w1").wait_for()
    rid = models[0].requests[-1].request_id
    await page.keyboard.press("Escape")
    await finished(page)
    for _ in range(40):
        if models[0].cancelled(rid):
            break
        await page.wait_for_timeout(50)
    assert models[0].cancelled(rid)


async def test_error_envelopes_are_shown_plainly(page: Any) -> None:
    answer = await send(page, "refuse")
    await finished(page)
    error = await answer.locator(".msg-error").inner_text()
    assert error == ("400 invalid_request_error (param messages): This model's maximum context "
                     "length is 4096 tokens.")
    answer = await send(page, "error")
    await finished(page)
    assert "the engine went away" in await answer.locator(".msg-error").inner_text()
    # a request the gateway's validation refuses: temperature out of range, named in the error
    await page.click("#open-settings")
    await page.fill("#set-temperature", "7")
    await page.press("#set-temperature", "Tab")
    answer = await send(page, "hello")
    await finished(page)
    error = await answer.locator(".msg-error").inner_text()
    assert error.startswith("400 invalid_request_error (param temperature)"), error
