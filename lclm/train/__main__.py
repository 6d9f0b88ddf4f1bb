"""`python -m lclm.train`: the training program, lclm/train_program.py (also `lclm-train` and
`python train.py`). This package holds only the launcher, so it stands above the program (whose
stage gates score RULER with evaluation's code); the training library is `lclm.training`."""

import sys

from lclm.train_program import main

if __name__ == "__main__":
    sys.exit(main())
