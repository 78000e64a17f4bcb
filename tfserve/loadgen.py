"""`python -m tfserve.loadgen`: the load generator, now `tfserve.bench.loadgen`."""

import sys

from tfserve.bench.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
