"""`flotilla chat` (also `python -m flotilla.services.chat`): chat with a running gateway in a
terminal.

    flotilla chat [--url URL] [--model NAME] [--system TEXT] [--temperature T] [--top-p P]
                  [--max-tokens N] [--reasoning-effort E] [--thinking | --no-thinking]
                  [--hide-reasoning] [--live] [--api-key KEY]

Rules:
- Each line typed is a question; the answer streams (Markdown with `--live`), reasoning dimmed.
- Ctrl-C while an answer streams stops it (the gateway cancels the generation); Ctrl-C at the
  prompt, or `/new` (`/clear`), starts a new chat; `/exit` (`/quit`) or end of input quits.
- Standard input need not be a terminal: lines are read the same way, so scripts and tests
  drive it through a pipe.
"""

from __future__ import annotations

import argparse
import sys

import openai
from rich.console import Console

from flotilla.libs.common.settings import LauncherSettings
from flotilla.services.chat.args import add_arguments
from flotilla.services.chat.render import LiveView, PlainView
from flotilla.services.chat.session import AnswerView, ChatOptions, ChatSession, describe_error

HELP = "commands: /new (or /clear) starts a new chat, /exit (or /quit) quits, /help"


def _read_line(console: Console) -> str:
    console.print("[bold green]>[/] ", end="")
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0)
    model = args.model
    if model is None:
        try:
            listed = [m.id for m in client.models.list().data]
        except openai.OpenAIError as exc:
            console.print(f"flotilla chat: {describe_error(exc)}", style="bold red",
                          markup=False)
            return 1
        if not listed:
            console.print(f"flotilla chat: {args.url} serves no model yet", style="bold red")
            return 1
        model = listed[0]
    session = ChatSession(client, ChatOptions(
        model=model, system=args.system, temperature=args.temperature, top_p=args.top_p,
        max_tokens=args.max_tokens, reasoning_effort=args.reasoning_effort,
        thinking=args.thinking))
    console.print(f"chatting with {model} at {args.url} — Ctrl-C stops an answer; {HELP}",
                  style="dim", markup=False)
    while True:
        try:
            line = _read_line(console)
        except KeyboardInterrupt:
            session.new()
            console.print("\n(new chat)", style="dim")
            continue
        except EOFError:
            console.print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return 0
            if command in ("/new", "/clear"):
                session.new()
                console.print("(new chat)", style="dim")
            else:
                console.print(HELP, style="dim")
            continue
        view: AnswerView = (LiveView(console, not args.hide_reasoning) if args.live
                            else PlainView(console, not args.hide_reasoning))
        session.ask(line, view)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flotilla chat", description="Chat with a running "
                                     "flotilla gateway in the terminal.")
    add_arguments(parser, LauncherSettings())
    return run(parser.parse_args(argv))
