"""``python -m kiln.cli``: the same as the ``kiln`` command."""

import sys

from kiln.cli.main import main

sys.exit(main())
