"""`python -m service [ARTIFACT] [--flags]`: the same as `reformer serve`."""

import sys

from service.api.server import main

sys.exit(main(sys.argv[1:]))
