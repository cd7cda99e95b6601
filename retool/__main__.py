import sys

from retool.cli import main

sys.exit(main())
