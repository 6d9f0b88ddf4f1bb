"""`python -m lclm.train`: the training program, lclm/train_program.py (also `lclm-train` and
`python train.py`). The one file of this package above lclm.eval: Python runs
`python -m lclm.train` from here, and the program it starts scores its stage gates' RULER
subsets with evaluation's code (tests/test_imports.py ranks this launcher above the program)."""

import sys

from lclm.train_program import main

if __name__ == "__main__":
    sys.exit(main())
