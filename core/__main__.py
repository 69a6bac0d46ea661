"""`python -m rlcore`: the same as the `rlcore` command."""

import sys

from .cli import main

sys.exit(main())
