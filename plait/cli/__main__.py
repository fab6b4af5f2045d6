"""`python -m plait.cli ...` (what torchrun and the tests start): the `plait` command."""

import sys

from plait.cli import main

sys.exit(main())
