"""The command line of `flotilla chat`, apart from the chat itself so that the launcher's
parser can offer it without importing the openai SDK and rich (seconds off `flotilla up`)."""

from __future__ import annotations

import argparse

from flotilla.libs.common.settings import LauncherSettings


def add_arguments(parser: argparse.ArgumentParser, settings: LauncherSettings) -> None:
    default_url = f"http://{settings.host}:{settings.port}/v1"
    parser.add_argument("--url", default=default_url,
                        help=f"the gateway's OpenAI base URL (default: {default_url})")
    parser.add_argument("--model", default=None,
                        help="model name (default: the first one the gateway lists)")
    parser.add_argument("--system", "--system-prompt", "--system_prompt", dest="system",
                        default=None, metavar="TEXT", help="system prompt")
    parser.add_argument("--temperature", type=float, default=None, metavar="T")
    parser.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=None,
                        metavar="P")
    parser.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int,
                        default=None, metavar="N")
    parser.add_argument("--reasoning-effort", default=None, choices=["low", "medium", "high"],
                        metavar="E", help="low, medium or high (models that support it)")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                        help="turn the model's thinking on or off (chat_template_kwargs."
                             "enable_thinking; default: the model's own)")
    parser.add_argument("--hide-reasoning", action="store_true",
                        help="do not print the reasoning text")
    parser.add_argument("--live", action="store_true",
                        help="render each answer as Markdown while it streams")
    parser.add_argument("--api-key", default="unused",
                        help="sent as Authorization: Bearer (when the gateway requires keys)")
