import sys

from hgopt.cli import main

sys.exit(main())
