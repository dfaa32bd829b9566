"""What ``AKV_SCHED_BATCH`` is worth: ``step_ab.py sched-batch`` (see there), under the name
the measurements in docs/benchmarks.md were made with::

    export AKV_SCHED_BATCH=0
    akv-launch -n 2 -s 1 -- python docs/profiling/sched_batch_ab.py 4000
    akv-launch -n 2 -s 1 -- python docs/profiling/sched_batch_ab.py 4000 dense 1956
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import main  # found through the path above

if __name__ == "__main__":
    main(["sched-batch", *sys.argv[1:]])
