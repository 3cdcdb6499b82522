"""``python -m kvfsm``: the same as the ``kvfsm`` command."""

import sys

from kvfsm.cli import console

sys.exit(console())
