"""`python -m flotilla.services.tokenizer [--model M] [--chat-template FILE] ...` (or FLOTILLA_*
env)."""

from __future__ import annotations

from flotilla.libs.common.service import run_forever
from flotilla.libs.common.settings import TokenizerSettings
from flotilla.services.tokenizer.service import TokenizerService


def main() -> None:
    settings = TokenizerSettings(_cli_parse_args=True, _cli_kebab_case=True)  # type: ignore[call-arg]
    run_forever("tokenizer", settings, lambda bus: TokenizerService(settings, bus))


if __name__ == "__main__":
    main()
