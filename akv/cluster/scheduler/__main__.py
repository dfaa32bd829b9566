import sys

from akv.cluster.scheduler import main

sys.exit(main())
