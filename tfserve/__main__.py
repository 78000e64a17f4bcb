import sys

from tfserve.cli import main

sys.exit(main())
