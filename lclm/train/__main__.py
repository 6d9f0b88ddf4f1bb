"""`python -m lclm.train`: the training program (`lclm.train.program`; also `lclm-train` and
`python train.py`)."""

import sys

from lclm.train.program import main

if __name__ == "__main__":
    sys.exit(main())
