"""python -m plait.combinations docs/compose.md: regenerate the page's matrix from the table."""

import sys
from pathlib import Path

from plait.combinations.render import with_table

page = Path(sys.argv[1])
page.write_text(with_table(page.read_text()))
