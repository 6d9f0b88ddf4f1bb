"""`python -m lclm.eval TASK [options]` (also `lclm-eval TASK`): one command for the
evaluation tasks, each with the model, mesh and attention flags of `lclm.eval.model` and its
own report `OUT/<task>.{md,json,png}`.

    perplexity      loss by token position over held-out documents  (lclm.eval.perplexity)
    passkey         a number hidden in filler text                   (lclm.eval.passkey)
    needle          a sentence hidden in your documents              (lclm.eval.needle)
    line-retrieval  numbered lines, one asked for                    (lclm.eval.line_retrieval)
    ruler           RULER's generated tasks, effective length         (lclm.eval.ruler)

`python -m lclm.eval TASK --help` lists a task's flags.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from lclm.eval import line_retrieval, needle, passkey, perplexity, ruler

TASKS: dict[str, Callable[..., int]] = {
    "perplexity": perplexity.main,
    "passkey": passkey.main,
    "needle": needle.main,
    "line-retrieval": line_retrieval.main,
    "ruler": ruler.main,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)  # no task: a misuse
        return 0 if argv else 2
    task, rest = argv[0], argv[1:]
    if task not in TASKS:
        print(
            f"error: unknown task {task!r}; use one of {', '.join(TASKS)} "
            "(python -m lclm.eval TASK --help)",
            file=sys.stderr,
        )
        return 2
    return TASKS[task](rest, prog=f"python -m lclm.eval {task}")


if __name__ == "__main__":
    sys.exit(main())
