"""The entry points' command line: bad input is one line, before anything compiles.

Every entry point (`train`, `plan`, `bench`, `graph`, `export`, `generate`) reports input that
cannot work as one line `error: FIELD: problem` on stderr and exits with code 2: a `--config`
file that does not exist, a `--config.KEY` that `jaxrlhf/schema.py` does not know, a flag absl
refuses, stray arguments, and any `ConfigError` its checks raise.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags

from jaxrlhf import shipped
from jaxrlhf.schema import ConfigError, unknown_key

EXIT_BAD_INPUT = 2


def error_line(message) -> str:
    """`error: message` on one line (whitespace runs, newlines included, become one space)."""
    return f"error: {' '.join(str(message).split())}"


def bad_input(message) -> NoReturn:
    print(error_line(message), file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with a `--config=FILE[:VARIANT]` naming no file, a `--config.KEY=...`
    whose KEY is not in jaxrlhf/schema.py, and absl's own errors reported in one line.

    `--config=configs/NAME.py` names the shipped config where the working directory holds no
    such file (jaxrlhf/shipped.py)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name == "--config":
            path, colon, variant = value.partition(":")
            if not os.path.isfile(found := shipped.resolve(path)):
                bad_input(f"--config={path}: no such config file")
            argv[i] = f"--config={found}{colon}{variant}"
        if name.startswith("--config.") and (error := unknown_key(name[len("--config."):])):
            bad_input(f"--config.{error}")
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        bad_input(e)


_DASHED_FLAG = re.compile(r"^(--?)([A-Za-z][\w-]*)(=.*)?$", re.DOTALL)


def parse_dashed_flags(argv: list[str]) -> list[str]:
    """`parse_flags`, accepting `--max-new-tokens` as a spelling of `--max_new_tokens`."""

    def undash(arg: str) -> str:
        match = _DASHED_FLAG.match(arg)
        if match is None or arg == "--":
            return arg
        dashes, name, value = match.groups()
        return dashes + name.replace("-", "_") + (value or "")

    return parse_flags([argv[0], *map(undash, argv[1:])])


def run(main: Callable[[], None], flags_parser=parse_flags) -> None:
    """`absl.app.run` of `main()` (no positional arguments are taken), with its ConfigError
    reported as one line."""

    def checked(argv: list[str]) -> None:
        if len(argv) > 1:
            bad_input(f"unexpected arguments: {argv[1:]}")
        try:
            main()
        except ConfigError as e:
            bad_input(e)

    app.run(checked, flags_parser=flags_parser)
