"""`python -m keras_ring`: the `keras-ring-run` command, for environments without it."""

import sys

from keras_ring.launcher._main import main

if __name__ == "__main__":
    sys.exit(main())
