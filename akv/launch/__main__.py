import sys

from akv.launch import main

sys.exit(main())
