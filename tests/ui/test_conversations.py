"""Conversations, settings and layout in headless Chromium: history across reloads, rename,
delete, export, regenerate, edit-and-resend, the model picker, remembered settings and the API
key, themes, phone width, and the page's load time and console."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.ui.conftest import finished, models_listed, send

pytestmark = pytest.mark.timeout(90)


async def conversation_titles(page: Any) -> list[str]:
    return [t.strip() for t in await page.locator(".conv-title").all_inner_texts()]


async def test_conversations_persist_rename_export_delete(page: Any, tmp_path: Path) -> None:
    await send(page, "first question")
    await finished(page)
    await page.click("#new-chat")
    await send(page, "markdown")
    await finished(page)
    assert await conversation_titles(page) == ["markdown", "first question"]

    await page.reload()
    await page.locator(".conv-title").first.wait_for()
    assert await conversation_titles(page) == ["markdown", "first question"]
    assert await page.locator("article.msg").count() == 2  # the latest conversation is shown
    assert await page.locator(".conv.active .conv-title").inner_text() == "markdown"
    await page.locator(".conv-title", has_text="first question").click()
    assert await page.locator("article.msg.user .msg-body").inner_text() == "first question"
    assert await page.locator("article.msg.assistant .msg-body").inner_text() == "Hello world !"

    await page.click(".conv.active [data-act=rename]")
    await page.fill(".conv.active input.rename", "Renamed chat")
    await page.press(".conv.active input.rename", "Enter")
    await page.reload()
    await page.locator(".conv-title", has_text="Renamed chat").wait_for()

    await page.locator(".conv-title", has_text="Renamed chat").click()
    async with page.expect_download() as info:
        await page.click(".conv.active [data-act=json]")
    download = await info.value
    assert download.suggested_filename == "Renamed-chat.json"
    saved = json.loads(Path(await download.path()).read_text())
    assert saved["title"] == "Renamed chat"
    assert [(m["role"], m["content"]) for m in saved["messages"]] == [
        ("user", "first question"), ("assistant", "Hello world !")]
    async with page.expect_download() as info:
        await page.click(".conv.active [data-act=md]")
    markdown = Path(await (await info.value).path()).read_text()
    assert markdown.startswith("# Renamed chat\n")
    assert "## User\n\nfirst question\n" in markdown
    assert "## Assistant\n\nHello world !\n" in markdown

    # the first click only arms the button (for 3 s; a loaded machine must not let it lapse
    # before the second click, so nothing slower than this check sits between the two)
    await page.click(".conv.active [data-act=delete]")
    assert await page.locator(".conv.active [data-act=delete]").inner_text() == "Delete?"
    await page.click(".conv.active [data-act=delete]")
    await page.locator(".conv-title", has_text="Renamed chat").wait_for(state="detached")
    await page.reload()
    await page.locator(".conv-title").first.wait_for()
    assert await conversation_titles(page) == ["markdown"]


async def test_regenerate_and_edit_and_resend(page: Any, models) -> None:
    fake = models[0]
    await send(page, "hello")
    await finished(page)
    before = len(fake.requests)
    await page.click("article.msg.assistant [data-action=regenerate]")
    await finished(page)
    assert len(fake.requests) == before + 1
    assert fake.requests[-1].messages == [{"role": "user", "content": "hello"}]
    assert await page.locator("article.msg").count() == 2  # the old answer was replaced

    await page.click("article.msg.user [data-action=edit]")
    await page.fill("article.msg.user textarea", "think")
    await page.press("article.msg.user textarea", "Enter")
    await finished(page)
    assert fake.requests[-1].messages == [{"role": "user", "content": "think"}]
    assert await page.locator("article.msg").count() == 2
    assert await page.locator("article.msg.assistant .msg-body").inner_text() == \
        "The answer is 42."
    # the history goes with the next question
    await send(page, "again")
    await finished(page)
    assert [m["role"] for m in fake.requests[-1].messages] == ["user", "assistant", "user"]
    assert fake.requests[-1].messages[1]["content"] == "The answer is 42."


async def test_model_picker_lists_the_served_models_and_switches(page: Any, models,
                                                                 gateway) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=gateway.url) as http:
        served = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    options = await page.locator("#model option").all_inner_texts()
    assert sorted(options) == sorted(served)
    assert {m.model for m in models} <= set(options)
    await page.select_option("#model", models[1].model)
    before = len(models[1].requests)
    answer = await send(page, "hello")
    await finished(page)
    assert len(models[1].requests) == before + 1 and models[1].requests[-1].model == models[1].model
    assert models[1].model in await answer.locator(".msg-role").inner_text()
    await page.reload()  # the choice is remembered
    await models_listed(page)
    assert await page.input_value("#model") == models[1].model


async def test_settings_are_remembered_and_sent(page: Any, models) -> None:
    fake = models[0]
    await page.select_option("#model", fake.model)
    await page.click("#open-settings")
    await page.fill("#set-system", "You are terse.")
    await page.fill("#set-temperature", "0.3")
    await page.fill("#set-top-p", "0.9")
    await page.fill("#set-max-tokens", "64")
    await page.select_option("#set-thinking", "off")
    await page.fill("#set-api-key", "sk-test-123")
    await page.press("#set-api-key", "Tab")
    await page.reload()
    await models_listed(page)
    assert await page.input_value("#set-system") == "You are terse."
    assert await page.input_value("#set-temperature") == "0.3"
    assert await page.input_value("#set-max-tokens") == "64"
    assert await page.input_value("#set-thinking") == "off"

    async with page.expect_request("**/v1/chat/completions") as info:
        await send(page, "hello")
    await finished(page)
    request = await info.value
    assert request.headers["authorization"] == "Bearer sk-test-123"
    body = json.loads(request.post_data)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    sent = fake.requests[-1]
    assert sent.messages[0] == {"role": "system", "content": "You are terse."}
    assert sent.sampling.temperature == pytest.approx(0.3)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert sent.sampling.max_tokens == 64


async def test_themes_and_phone_width(page: Any, screenshots: Path) -> None:
    await send(page, "wide")
    await finished(page)
    await send(page, "markdown")
    await finished(page)
    light = await page.evaluate("getComputedStyle(document.body).backgroundColor")
    await page.click("#theme")
    assert await page.evaluate("document.documentElement.dataset.theme") == "dark"
    dark = await page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert light != dark
    await page.screenshot(path=str(screenshots / "desktop-dark-answer.png"))

    await page.set_viewport_size({"width": 390, "height": 844})
    await page.wait_for_timeout(200)
    overflow = await page.evaluate(
        "[document.scrollingElement.scrollWidth, document.documentElement.clientWidth]")
    assert overflow[0] <= overflow[1], f"horizontal scroll at phone width: {overflow}"
    assert not await page.locator("#sidebar").is_visible() or \
        (await page.locator("#sidebar").bounding_box())["x"] < 0
    await page.screenshot(path=str(screenshots / "phone-dark.png"))
    await page.click("#theme")
    await page.screenshot(path=str(screenshots / "phone-light.png"))
    await page.click("#open-sidebar")
    await page.wait_for_timeout(300)
    box = await page.locator("#sidebar").bounding_box()
    assert box["x"] >= 0 and box["width"] <= 390
    await page.screenshot(path=str(screenshots / "phone-light-conversations.png"))
    await page.locator(".conv-title").first.click()
    await page.wait_for_timeout(300)
    assert (await page.locator("#sidebar").bounding_box())["x"] < 0


async def test_page_loads_fast_without_errors_or_other_origins(page: Any, gateway) -> None:
    await page.reload()
    await models_listed(page)
    load_ms = await page.evaluate(
        "performance.getEntriesByType('navigation')[0].loadEventEnd")
    assert 0 < load_ms < 1000, f"the page took {load_ms:.0f} ms to load"
    assert not page.log.console_errors, page.log.console_errors
    assert not page.log.foreign_requests(), page.log.foreign_requests()
