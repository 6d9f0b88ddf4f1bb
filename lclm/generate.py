"""`python -m lclm.generate`, the README's generation command before generation moved into
the evaluation package: an alias of `python -m lclm.eval.generate` (also `lclm-generate`) that
says so on stderr and runs it with the same arguments. Importers get `lclm.eval.generate`'s
names (`continuation`, `prompt_ids`, ...) from here too."""

from __future__ import annotations

import sys

from lclm.eval import generate

MOVED = (
    "note: python -m lclm.generate is now python -m lclm.eval.generate (also "
    "lclm-generate); running it"
)


def main(argv: list[str] | None = None) -> int:
    print(MOVED, file=sys.stderr)
    return generate.main(argv)


def __getattr__(name: str):
    return getattr(generate, name)


if __name__ == "__main__":
    sys.exit(main())
