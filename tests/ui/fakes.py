"""The gateway tests' fake tokenizer with the answers a chat UI has to show, chosen by the last
user message like the base fake's ("slow", "refuse", "error", "tools" come from there):

- "markdown"  → a heading, a list, a link and a Python code block, in many small deltas
- "xss"       → hostile Markdown/HTML: script, onerror image, javascript: link, remote image
- "think"     → reasoning in several deltas (slowly), then the answer
- "wide"      → a long unbroken word and a long code line (phone-width layout)
"""

from __future__ import annotations

import asyncio
from typing import Any

from flotilla.libs.common.messages import TextDelta, TextFinal, TextRequest, Usage
from tests.gateway.fakes import FakeTokenizer

CODE = 'def greet(name):\n    return f"Hello, {name}!"\n'
MARKDOWN = (
    "## Greeting\n\nHere is **the** answer:\n\n- one\n- two\n\n"
    "See [the docs](https://example.com/docs).\n\n```python\n" + CODE + "```\n\nDone."
)
XSS = (
    "Hostile: <img src=x onerror=\"window.__pwned=1\"> and <script>window.__pwned=2</script>\n\n"
    "[click me](javascript:window.__pwned=3) and ![pic](https://tracker.invalid/p.png)\n\n"
    '<a href="javascript:window.__pwned=4">raw link</a> '
    '<svg><g onload="window.__pwned=5"></g></svg> [safe](https://example.com/)'
)
REASONING = ["First, ", "consider ", "the question. ", "Then ", "answer it."]
WIDE = ("x" * 300) + "\n\n```text\n" + ("y" * 300) + "\n```\n"


def pieces(text: str, size: int = 6) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class UiFakeTokenizer(FakeTokenizer):
    async def _stream(self, req: TextRequest, scenario: str, writer: Any) -> None:
        texts = {"markdown": MARKDOWN, "xss": XSS, "wide": WIDE}
        if scenario in texts:
            chunks = pieces(texts[scenario])
            for piece in chunks:
                await writer.data(TextDelta(text=piece))
                await asyncio.sleep(0.01)
            await writer.final(TextFinal(finish_reason="stop", usage=Usage(
                prompt_tokens=7, completion_tokens=len(chunks))))
            return
        if scenario == "think":
            for piece in REASONING:
                if self.cancelled(req.request_id):
                    writer.close()
                    return
                await writer.data(TextDelta(reasoning=piece))
                await asyncio.sleep(0.15)
            await writer.data(TextDelta(text="The answer is 42."))
            await writer.final(TextFinal(finish_reason="stop", usage=Usage(
                prompt_tokens=7, completion_tokens=len(REASONING) + 1)))
            return
        await super()._stream(req, scenario, writer)
