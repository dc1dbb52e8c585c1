"""`python -m flotilla.services.tools`: the MCP tools service."""

from __future__ import annotations

import sys

from flotilla.libs.common.service import run_forever
from flotilla.libs.common.settings import ToolsSettings
from flotilla.services.tools.config import ToolsConfigError, load_mcp_config
from flotilla.services.tools.service import ToolsService


def main() -> None:
    settings = ToolsSettings()
    try:
        load_mcp_config(settings.mcp_config)  # fail before connecting, with the file's problem
    except ToolsConfigError as exc:
        print(f"flotilla tools: {exc}", file=sys.stderr)
        sys.exit(2)
    run_forever("tools", settings, lambda bus: ToolsService(settings, bus))


if __name__ == "__main__":
    main()
