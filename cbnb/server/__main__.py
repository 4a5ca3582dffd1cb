"""`python -m cbnb.server MODEL [flags]` = `cbnb serve MODEL [flags]` (see `cbnb.server.cli`)."""

import sys

from .cli import main

argv = sys.argv[1:]
sys.exit(main(argv if argv[:1] == ["serve"] else ["serve", *argv]))
