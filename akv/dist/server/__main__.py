import sys

from akv.dist.server import main

sys.exit(main())
