import sys

from services.chat.cli import main

sys.exit(main())
