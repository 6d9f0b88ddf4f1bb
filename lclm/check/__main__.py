"""Before renting hardware: run a config's model, data and attention here, for a few rows,
and check what a misconfigured long-context run gets wrong first.

    python -m lclm.check --config FILE [--config.a.b=V ...] [--length N]   (or: lclm-check)

One line per check, `ok` or `FAIL` with the numbers and what to fix: (1) the first step's
loss at the target length against a short one (broken positions start near ln V), (2) the
configured mesh and attention strategy against one device (sp=1), (3) no token attends
across a packed document's boundary; and for a config made for `python -m lclm.extend` (stages
from trained weights, `extension.data` set), that its held-out data holds enough documents at
every length the extension measures. A staged config is checked at its last (longest) and
first stage. The mesh shrinks to the devices there are (simulated CPU devices where there is
no accelerator), keeping sp where they allow; `--length N` caps the target length (the output
says so). Exit status 0 when every check passes, 1 when one fails, 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys

from ml_collections import ConfigDict

from lclm.check.checks import CHECKS
from lclm.check.setup import prepare
from lclm.cli import parse_cli, run_cli
from lclm.config import mesh_device_count
from lclm.config.stages import stage_configs
from lclm.config.syntax import parse_tokens
from lclm.extend.heldout import is_extension, preflight
from lclm.parallel.devices import request_cpu_devices

SIMULATED_DEVICES = 8  # at most, where no accelerator is: enough for sp=4 x 2 rows


def chosen_stages(config) -> list[tuple[str, ConfigDict]]:
    """(label, training config) of what is checked: the last stage (the longest) and the
    first of a schedule, else the config itself."""
    stages = stage_configs(config)
    if not stages:
        return [("", config)]
    names = [f"stage {i + 1}/{len(stages)} ({s.data.seq_len} tokens)" for i, s in enumerate(stages)]
    picked = [len(stages) - 1] + ([0] if len(stages) > 1 else [])
    return [(names[i], stages[i]) for i in picked]


def run_checks(config, length: int | None, out=print) -> int:
    """Prepare and check every chosen stage, printing each line; 0 when all pass, else 1."""
    stages = chosen_stages(config)
    first = stage_configs(config)[0] if len(stages) > 1 else stages[0][1]
    failed = 0
    if is_extension(config):  # what python -m lclm.extend will measure it on
        ok, line = preflight(config)
        failed += not ok
        out(line)
    for label, stage in stages:
        run = prepare(stage, first, length)
        out(
            f"{label + ': ' if label else ''}weights {run.weights}"
            + "".join(f"; {note}" for note in run.notes)
        )
        for check in CHECKS:
            result = check(run)
            failed += not result.ok
            out(result.line())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lclm.check", description=__doc__)
    parser.add_argument(
        "--length",
        type=parse_tokens,
        metavar="N",
        help="cap the target length at N tokens (e.g. 8k) for a small machine",
    )

    def body() -> int:
        args, config = parse_cli(parser, argv)
        # before JAX starts its backends (importing it does not), as the training program does
        stages = stage_configs(config) or [config]
        request_cpu_devices(
            min(max(mesh_device_count(c) or SIMULATED_DEVICES for c in stages), SIMULATED_DEVICES)
        )
        return run_checks(config, args.length)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
