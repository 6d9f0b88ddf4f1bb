"""The command line every lclm CLI shares: `PROG [--config FILE] [--config.a.b=V ...]` gives
the config (train.py's syntax for every program), and `run_cli` turns the errors a user can
fix into one line on stderr and an exit status (2: bad input at start, 3: a run that stopped
itself) instead of a traceback. Every such program's `--help` lists the config fields with
their defaults and the schema's comments on them (`config_help`), and `--print-config`
prints the config it would run with (the file and the overrides applied, secrets left out)
and exits 0 without starting anything.

No JAX here: CLIs read their config before JAX starts (simulated devices are requested from
the mesh size first).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Callable, Iterator

import ml_collections
from absl import flags
from ml_collections import config_flags

from lclm.config import base_config, schema
from lclm.config import model as model_schema
from lclm.config.files import field, load_config
from lclm.config.secrets import public_config
from lclm.config.stages import keys_set_by_stages
from lclm.errors import ConfigError, StartupError, TrainingHalted

PRINT_CONFIG = "--print-config"


def run_cli(body: Callable[[], int | None],
            input_errors: tuple[type[BaseException], ...] = ()) -> int:
    """`body()`'s exit status (None: 0). A StartupError, a missing file or one of
    `input_errors` (what else means bad input to this CLI, e.g. ValueError for a program
    whose inputs are parsed by libraries) is `error: ...` on stderr and status 2; a
    TrainingHalted is `error: ...` and status 3."""
    bad_input: tuple[type[BaseException], ...] = (StartupError, FileNotFoundError, *input_errors)
    try:
        return body() or 0
    except bad_input as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingHalted as e:
        print(f"error: {e}", file=sys.stderr)
        return 3


def config_main(argv: list[str], default: str, doc: str,
                run: Callable[[ml_collections.ConfigDict], None]) -> int:
    """The exit status of a program configured by its command line alone (train.py):
    `-h`/`--help` prints `doc` and `config_help()`; `--print-config` prints the config
    `config_from_argv` reads (`config_text`) and runs nothing; else `run(config)` under
    `run_cli`."""
    if {"-h", "--help"} & set(argv[1:]):
        print(f"{doc.rstrip()}\n\n{config_help()}")
        return 0
    print_only = PRINT_CONFIG in argv[1:]
    argv = [a for a in argv if a != PRINT_CONFIG]

    def body() -> None:
        config = config_from_argv(argv, default)
        if print_only:
            print(config_text(config))
        else:
            run(config)

    return run_cli(body)


def config_from_argv(argv: list[str], default: str,
                     runs_stages: bool = True) -> ml_collections.ConfigDict:
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
    holder = config_flags.DEFINE_config_file("config", path, "config file", flag_values=values,
                                             sys_argv=argv)
    try:
        rest = values(argv)
    except flags.UnrecognizedFlagError as e:
        raise ConfigError(f"{e}; set config fields with --config.<key>=<value>") from None
    except flags.Error as e:
        raise ConfigError(str(e)) from None
    if rest[1:]:
        raise ConfigError(f"unexpected arguments {rest[1:]}; pass only --config FILE and "
                          "--config.<key>=<value>")
    config = holder.value
    if runs_stages:
        _check_stage_overrides(config, _override_keys(argv))
    return config


def _check_stage_overrides(config, keys: list[str]) -> None:
    """An override of a key that every (or some) stage of `stages.schedule` replaces would
    be silently lost: refuse it (the schedule, where the stages are, is what to change)."""
    if not config.stages.schedule:
        return
    replaced = keys_set_by_stages(config)
    for key in keys:
        if key in replaced:
            raise ConfigError(f"config.{key} is {replaced[key]}")


def parse_cli(parser: argparse.ArgumentParser, argv: list[str] | None, default: str | None = None,
              runs_stages: bool = True) -> tuple[argparse.Namespace, ml_collections.ConfigDict]:
    """(the CLI's own arguments, its config) of `PROG --config FILE [--config.a.b=V ...]
    [the parser's own arguments]`: every CLI configures the run the way train.py does.

    `parser` defines only the CLI's own arguments; `--config` (required unless `default`) is
    added here. The `--config.*` arguments go to `config_from_argv` (its checks, its one-line
    errors) and are kept in `args.overrides`, to be passed on as they are (to child processes).
    """
    parser.add_argument("--config", metavar="FILE", default=default, required=default is None,
                        help="config file" + (f" (default {default})" if default else "")
                        + "; override its fields with --config.<key>=<value>")
    parser.add_argument(PRINT_CONFIG, action="store_true",
                        help="print the config (file and overrides applied, secrets left out) "
                             "and exit")
    # the field list keeps its lines (the description and epilog of lclm's CLIs are short)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n\n".join(filter(None, [parser.epilog, config_help()]))
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for arg in rest:
        if arg.startswith("-") and not re.match(r"-{1,2}(?:no)?config\.|-[\d.]", arg):
            raise ConfigError(f"unrecognized argument {arg!r}; see --help (config fields: "
                              "--config.<key>=<value>)")
    args.overrides = rest
    config = config_from_argv([parser.prog, "--config", args.config, *rest], args.config,
                              runs_stages)
    if args.print_config:
        print(config_text(config))
        parser.exit()
    return args, config


def config_text(config: ml_collections.ConfigDict) -> str:
    """`key=value` lines (`model.dim=2048`, values as Python writes them) of every field of
    `config` but the secrets, sorted: what `--print-config` prints."""
    return "\n".join(f"{key}={value!r}" for key, value in _flat(public_config(config)))


def config_help() -> str:
    """Every config field as `key=default` (`base_config`'s defaults, which a config file
    changes), each under the comment that lclm/config/schema.py or lclm/config/model.py
    writes beside or above it, a section's comment before its first field."""
    docs = _field_docs()
    lines = ["config fields (--config.<key>=<value>) with lclm.config.base_config's defaults; a",
             "config file changes some (--print-config prints what a run gets):"]
    section = ""
    for key, value in _flat(base_config().to_dict()):
        head = key.rpartition(".")[0]
        if head != section and head in docs:
            lines += textwrap.wrap(docs[head], 92, initial_indent="  # ",
                                   subsequent_indent="  # ")
        section = head
        lines.append(f"  {key}={value!r}")
        lines += textwrap.wrap(docs.get(key, ""), 92, initial_indent=" " * 6,
                               subsequent_indent=" " * 6)
    return "\n".join(lines)


def _flat(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) of every leaf of a nested dict, keys sorted."""
    for name in sorted(tree):
        if isinstance(tree[name], dict):
            yield from _flat(tree[name], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", tree[name]


def _field_docs() -> dict[str, str]:
    """{dotted key or section: its comment} as base_config's source writes them; a section
    that takes its fields from a dataclass (`dataclasses.asdict(LlamaConfig())`) has the
    comments of that class's source for them (then its own, where it sets one again)."""
    model_source = inspect.getsource(model_schema)
    model_notes = _comment_notes(model_source)
    classes = {c.name: {f.target.id: model_notes(f.lineno) for f in c.body
                        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
               for c in ast.parse(model_source).body if isinstance(c, ast.ClassDef)}
    source = inspect.getsource(schema)
    notes = _comment_notes(source)
    base = next(f for f in ast.parse(source).body
                if isinstance(f, ast.FunctionDef) and f.name == "base_config")
    docs: dict[str, list[str]] = {}
    for stmt in base.body:  # `c.name = value`; a `ConfigDict(...)` value is a section
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Attribute)):
            continue
        name = stmt.targets[0].attr
        docs.setdefault(name, []).append(notes(stmt.lineno))
        if _call_name(stmt.value) == "ConfigDict":
            for key, doc in _section_fields(stmt.value, notes, classes, stmt.lineno):
                docs.setdefault(f"{name}.{key}", []).append(doc)
    return {key: "; ".join(filter(None, doc)) for key, doc in docs.items() if any(doc)}


def _section_fields(node: ast.expr, notes: Callable[..., str], classes: dict,
                    first_line: int) -> Iterator[tuple[str, str]]:
    """(field, its comment) of a section's expression: the keywords of its calls
    (`dict(name=...)`), the keys of its dicts and the fields of `dataclasses.asdict(Cls())`.
    The comment above `first_line` is the section's, not its fields'."""
    if isinstance(node, ast.Call) and _call_name(node) == "asdict":
        yield from classes.get(_call_name(node.args[0]), {}).items()
    elif isinstance(node, ast.Call):
        for arg in node.args:
            yield from _section_fields(arg, notes, classes, first_line)
        yield from ((k.arg, notes(k.lineno, leading=k.lineno != first_line))
                    for k in node.keywords if k.arg)
    elif isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values):
            if key is None:  # `**value`
                yield from _section_fields(value, notes, classes, first_line)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                yield key.value, notes(key.lineno, leading=key.lineno != first_line)


def _call_name(node: ast.expr) -> str:
    """The name of the function or method that `node` calls ('' where it calls none)."""
    func = node.func if isinstance(node, ast.Call) else None
    return getattr(func, "attr", getattr(func, "id", ""))


def _comment_notes(source: str) -> Callable[..., str]:
    """`notes(line, leading=True)`: the comment lines directly above code line `line` of
    `source` (where `leading`), then the comment ending that line with the comment lines
    aligned under it."""
    trailing: dict[int, str] = {}
    above: dict[int, str] = {}
    block: list[str] = []
    last = None  # (line, column, owner line) of the latest comment that follows code
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        (line, col), text = tok.start, tok.string.lstrip("#").strip()
        if tok.type == tokenize.COMMENT and tok.line[:col].strip():
            trailing[line], last = text, (line, col, line)
        elif tok.type == tokenize.COMMENT and last and last[:2] == (line - 1, col):
            trailing[last[2]] += " " + text
            last = (line, col, last[2])
        elif tok.type == tokenize.COMMENT:
            block.append(text)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT) and block:
            above[line], block = " ".join(block), []

    def notes(line: int, leading: bool = True) -> str:
        return " ".join(filter(None, [above.get(line) if leading else None,
                                      trailing.get(line)]))
    return notes


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
