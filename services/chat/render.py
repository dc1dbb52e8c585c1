"""How a terminal chat shows an answer (rich): reasoning dimmed, then the answer, tool calls,
errors in red and a dim line of numbers.

- `PlainView` prints each piece as it arrives (any terminal, pipes, logs).
- `LiveView` (`--live`) re-renders the answer as Markdown as it grows (rich's Live display).
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.text import Text

from flotilla.services.chat.session import Answer

REASONING_STYLE = "dim italic"


def summary(answer: Answer) -> Text:
    """The answer's tail: tool calls, the error or the stop, and its numbers."""
    out = Text()
    for call in answer.tool_calls:
        out.append(f"→ tool call {call.name}({call.arguments})\n", style="cyan")
    if answer.error:
        out.append(f"error: {answer.error}\n", style="bold red")
    numbers = []
    if answer.completion_tokens is not None:
        numbers.append(f"{answer.completion_tokens} tokens")
    if answer.tokens_per_s is not None:
        numbers.append(f"{answer.tokens_per_s:.1f} tok/s")
    if answer.ttft_s is not None:
        numbers.append(f"TTFT {answer.ttft_s * 1000:.0f} ms")
    if answer.stopped:
        numbers.append("stopped")
    elif answer.finish_reason and answer.finish_reason != "stop":
        numbers.append(f"finish: {answer.finish_reason}")
    if numbers:
        out.append("[" + " · ".join(numbers) + "]", style="dim")
    return out


class PlainView:
    def __init__(self, console: Console, show_reasoning: bool = True):
        self.console, self.show_reasoning = console, show_reasoning
        self._in_reasoning = False

    def _write(self, text: str, style: str | None = None) -> None:
        self.console.print(text, end="", style=style, markup=False, highlight=False,
                           soft_wrap=True)

    def reasoning(self, text: str) -> None:
        if self.show_reasoning:
            self._in_reasoning = True
            self._write(text, REASONING_STYLE)

    def content(self, text: str) -> None:
        if self._in_reasoning:
            self._write("\n\n")
            self._in_reasoning = False
        self._write(text)

    def close(self, answer: Answer) -> None:
        self._write("\n")
        tail = summary(answer)
        if tail:
            self.console.print(tail, soft_wrap=True)


class LiveView:
    def __init__(self, console: Console, show_reasoning: bool = True):
        self.console, self.show_reasoning = console, show_reasoning
        self._reasoning = ""
        self._content = ""
        self._live = Live(console=console, refresh_per_second=12, auto_refresh=False,
                          vertical_overflow="visible")
        self._live.start()

    def _render(self) -> Group:
        parts: list[Text | Markdown] = []
        if self._reasoning and self.show_reasoning:
            parts.append(Text(self._reasoning.strip() + "\n", style=REASONING_STYLE))
        parts.append(Markdown(self._content))
        return Group(*parts)

    def reasoning(self, text: str) -> None:
        self._reasoning += text
        self._live.update(self._render(), refresh=True)

    def content(self, text: str) -> None:
        self._content += text
        self._live.update(self._render(), refresh=True)

    def close(self, answer: Answer) -> None:
        self._live.update(self._render(), refresh=True)
        self._live.stop()
        tail = summary(answer)
        if tail:
            self.console.print(tail, soft_wrap=True)
