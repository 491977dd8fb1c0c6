"""``python -m loongsage_core`` is the ``loongsage`` command."""

import sys

from .cli import main

sys.exit(main())
