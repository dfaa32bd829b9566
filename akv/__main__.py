"""``python -m akv`` is the ``akv`` command."""

import sys

from akv.cli import main

sys.exit(main())
