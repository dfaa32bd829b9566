import sys

from akv.dist.scheduler import main

sys.exit(main())
