import sys

from flotilla.services.chat.cli import main

sys.exit(main())
