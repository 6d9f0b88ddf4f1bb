"""The command line every lclm CLI shares: `PROG [--config FILE] [--config.a.b=V ...]` gives
the config (train.py's syntax for every program), and `run_cli` turns the errors a user can
fix into one line on stderr and an exit status (2: bad input at start, 3: a run that stopped
itself) instead of a traceback. Every such program's `--help` lists the config fields with
their defaults, help, names and ranges as the schema declares them (`config_help`), and
`--print-config` prints the config it would run with (the file and the overrides applied,
secrets left out) and exits 0 without starting anything.

No JAX here: CLIs read their config before JAX starts (simulated devices are requested from
the mesh size first). `run_cli` is every CLI's door, so it is where JAX's platforms are chosen
(lclm.platforms: kept off an absent TPU) before the program starts JAX's backends.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable

import ml_collections
from absl import flags
from ml_collections import config_flags

from lclm import storage
from lclm.config import schema
from lclm.config.fields import fields_of
from lclm.config.loading import field, flat_items, load_config
from lclm.config.secrets import public_config
from lclm.config.stages import keys_set_by_stages, stage_lines
from lclm.errors import ConfigError, StartupError, TrainingHalted
from lclm.platforms import keep_jax_off_an_absent_tpu

PRINT_CONFIG = "--print-config"


def run_cli(
    body: Callable[[], int | None], input_errors: tuple[type[BaseException], ...] = ()
) -> int:
    """`body()`'s exit status (None: 0). A StartupError, a missing file or one of
    `input_errors` (what else means bad input to this CLI, e.g. ValueError for a program
    whose inputs are parsed by libraries) is `error: ...` on stderr and status 2, and so is
    storage that cannot be reached (an OSError: the storage clients' errors are ones); a
    TrainingHalted is `error: ...` and status 3. JAX's platforms are chosen first
    (`keep_jax_off_an_absent_tpu`): `body` may start its backends."""
    keep_jax_off_an_absent_tpu()
    bad_input: tuple[type[BaseException], ...] = (StartupError, FileNotFoundError, *input_errors)
    try:
        return body() or 0
    except bad_input as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # storage that cannot be reached (a bucket, a network filesystem)
        print(
            f"error: {storage.error_text(e)}; check the path, this machine's access to it "
            "and its network",
            file=sys.stderr,
        )
        return 2
    except TrainingHalted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3


def config_main(
    argv: list[str],
    default: str,
    doc: str,
    run: Callable[[ml_collections.ConfigDict], None],
    check: Callable[[ml_collections.ConfigDict], None] | None = None,
) -> int:
    """The exit status of a program configured by its command line alone (train.py):
    `-h`/`--help` prints `doc` and `config_help()`; `--print-config` prints the config
    `config_from_argv` reads (`config_text`), once `check(config)` has passed (the program's
    own start-up checks of what the config says), and runs nothing; else `run(config)` under
    `run_cli`."""
    if {"-h", "--help"} & set(argv[1:]):
        print(f"{doc.rstrip()}\n\n{config_help()}")
        return 0
    print_only = PRINT_CONFIG in argv[1:]
    argv = [a for a in argv if a != PRINT_CONFIG]

    def body() -> None:
        config = config_from_argv(argv, default)
        if print_only:
            if check is not None:
                check(config)
            print(config_text(config))
        else:
            run(config)

    return run_cli(body)


def config_from_argv(
    argv: list[str], default: str, runs_stages: bool = True
) -> ml_collections.ConfigDict:
    """The config of a command line `PROG [--config FILE] [--config.a.b=V ...]` (ml_collections
    syntax: typed, locked against new keys); FILE defaults to `default`.

    Every mistake (missing file, unknown key, bad value, stray argument) is one ConfigError
    line; an unknown key names the closest existing one. When the program runs the stages of
    `stages.schedule` (`runs_stages`; the benchmarks measure the file's own fields instead),
    an override of a field that a stage replaces is one too.
    """
    path = _config_path(argv) or default
    known = load_config(path)
    for key in _override_keys(argv):
        field(known, key)
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", path, "config file", flag_values=values, sys_argv=argv
    )
    try:
        rest = values(argv)
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(f"{e}; set config fields with --config.<key>=<value>") from None
    except flags.Error as e:
        raise ConfigError(str(e)) from None
    if rest[1:]:
        raise ConfigError(
            f"unexpected arguments {rest[1:]}; pass only --config FILE and --config.<key>=<value>"
        )
    config = holder.value
    if runs_stages:
        _check_stage_overrides(config, _override_keys(argv))
    return config


def _check_stage_overrides(config, keys: list[str]) -> None:
    """An override of a key that every (or some) stage of `stages.schedule` replaces would
    be silently lost: refuse it (the schedule, where the stages are, is what to change)."""
    replaced = keys_set_by_stages(config)
    for key in keys:
        if key in replaced:
            raise ConfigError(f"config.{key} is {replaced[key]}")


def parse_cli(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    default: str | None = None,
    runs_stages: bool = True,
) -> tuple[argparse.Namespace, ml_collections.ConfigDict]:
    """(the CLI's own arguments, its config) of `PROG --config FILE [--config.a.b=V ...]
    [the parser's own arguments]`: every CLI configures the run the way train.py does.

    `parser` defines only the CLI's own arguments; `--config` (required unless `default`) is
    added here. The `--config.*` arguments go to `config_from_argv` (its checks, its one-line
    errors) and are kept in `args.overrides`, to be passed on as they are (to child processes).
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        required=default is None,
        help="config file"
        + (f" (default {default})" if default else "")
        + "; override its fields with --config.<key>=<value>",
    )
    parser.add_argument(
        PRINT_CONFIG,
        action="store_true",
        help="print the config (file and overrides applied, secrets left out) and exit",
    )
    # the field list keeps its lines (the description and epilog of lclm's CLIs are short)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n\n".join(filter(None, [parser.epilog, config_help()]))
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for arg in rest:
        if arg.startswith("-") and not re.match(r"-{1,2}(?:no)?config\.|-[\d.]", arg):
            raise ConfigError(
                f"unrecognized argument {arg!r}; see --help (config fields: --config.<key>=<value>)"
            )
    args.overrides = rest
    config = config_from_argv(
        [parser.prog, "--config", args.config, *rest], args.config, runs_stages
    )
    if args.print_config:
        print(config_text(config))
        parser.exit()
    return args, config


def config_text(config: ml_collections.ConfigDict) -> str:
    """`key=value` lines (`model.dim=2048`, values as Python writes them) of every field of
    `config` but the secrets, sorted, then each stage's resolved values where they differ
    (`stages[i].key=value`): what `--print-config` prints."""
    return "\n".join(
        [
            *(f"{key}={value!r}" for key, value in flat_items(public_config(config))),
            *stage_lines(config),
        ]
    )


def config_help() -> str:
    """Every config field as `key=default` (`base_config`'s defaults, which a config file
    changes) with its help, accepted names and range as the schema declares them
    (`schema.SECTIONS`), each section under its own line."""
    lines = [
        "config fields (--config.<key>=<value>) with lclm.config.base_config's defaults; a",
        "config file changes some (--print-config prints what a run gets):",
    ]
    for name, section in schema.SECTIONS.items():
        lines += textwrap.wrap(
            " ".join((section.__doc__ or "").split()),
            92,
            initial_indent="  # ",
            subsequent_indent="  # ",
        )
        for f in fields_of(section):
            lines.append(f"  {name + '.' if name else ''}{f.name}={f.default!r}")
            words = (
                [f.help]
                + ([f"one of {', '.join(f.choices)}"] if f.choices else [])
                + ([f"{f.rule.says}" + (f" ({f.note})" if f.note else "")] if f.rule else [])
            )
            lines += textwrap.wrap(
                "; ".join(filter(None, words)),
                92,
                initial_indent=" " * 6,
                subsequent_indent=" " * 6,
            )
    return "\n".join(lines)


def _config_path(argv: list[str]) -> str | None:
    """FILE of `--config FILE` / `--config=FILE` (also with one dash, as absl allows)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--config", "-config"):
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _override_keys(argv: list[str]) -> list[str]:
    """`a.b` of every `--config.a.b=V`, `--config.a.b V` and boolean `--[no]config.a.b`."""
    found = (re.match(r"-{1,2}(?:no)?config\.([^=]+)", arg) for arg in argv)
    return [m.group(1) for m in found if m]
