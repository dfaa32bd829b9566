"""``python -m akv`` is the ``akv`` command."""

import sys

from akv._cli import main

sys.exit(main())
