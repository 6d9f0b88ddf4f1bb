"""Train a LLaMA with striped ring attention: `python train.py --config FILE
[--config.a.b=V ...]`, the same program as `lclm-train` and `python -m lclm.train` (see
lclm/train/program.py)."""

import sys

from lclm.train.program import main

if __name__ == "__main__":
    sys.exit(main())
