"""`python -m flotilla.services.launcher ...` is the `flotilla` command."""

import sys

from flotilla.services.launcher.cli import main

sys.exit(main())
