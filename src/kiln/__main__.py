"""``python -m kiln``: the same as the ``kiln`` command (and ``python -m kiln.cli``)."""

import sys

from kiln.cli.main import main

sys.exit(main())
