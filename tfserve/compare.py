"""`python -m tfserve.compare`: the engines comparison, now `tfserve.bench.compare`."""

import sys

from tfserve.bench.compare import main
from tfserve.bench.models import train_spm  # noqa: F401  (tests/marian_helpers.py imports it)

if __name__ == "__main__":
    sys.exit(main())
