import sys

from akv.cluster.server import main

sys.exit(main())
