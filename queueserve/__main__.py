import sys

from queueserve.ops.cli import main

sys.exit(main())
