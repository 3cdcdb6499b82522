"""``python -m kvfsm``: the same as the ``kvfsm`` command."""

import sys

from kvfsm.cli import main

sys.exit(main())
