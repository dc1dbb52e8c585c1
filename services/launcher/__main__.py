"""`python -m services.launcher ...` is the `flotilla` command."""

import sys

from services.launcher.cli import main

sys.exit(main())
