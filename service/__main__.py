"""`python -m service [ARTIFACT] [--flags]`: the same as `reformer serve`."""

import sys

from service.server import main

sys.exit(main(sys.argv[1:]))
