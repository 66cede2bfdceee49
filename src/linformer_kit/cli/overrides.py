"""Flags generated from dataclass fields that override a base config only when given.

Unlike `common.add_dataclass_arguments` (plain typed flags with the field's default), these
flags default to "not given", so `--config FILE` can supply the base values; the value type
comes from the field's annotation (bool, int, float, str, optional, lists). A bool flag alone
means true (`--resume`); `--resume false` also works.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from ..training.checkpoint import CheckpointWriteError

USAGE_ERROR = 2  # argparse's exit status for bad command-line input
TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def _parse_bool(text: str) -> bool:
    if text.lower() in TRUE + FALSE:
        return text.lower() in TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser(hint: Any) -> tuple[Callable[[str], Any], str | None]:
    """A converter for one command-line word, and argparse's nargs, for a type annotation."""
    if hint is bool:
        return _parse_bool, None
    if hint in (int, float, str):
        return hint, None
    origin, parts = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return parts[0], "+"
    if origin in (typing.Union, types.UnionType):
        options = [p for p in parts if p is not type(None)]
        scalar = next((p for p in options if p in (int, float, str)), str)
        has_list = any(typing.get_origin(p) is list for p in options)

        word = {int: "an integer", float: "a number"}.get(scalar, "text")
        forms = [word, *(["'none'"] if type(None) in parts else [])]
        forms += ["a comma-separated list of them (A,B,...)"] * has_list
        expected = f"{', '.join(forms[:-1])} or {forms[-1]}" if len(forms) > 1 else forms[0]

        def convert(text: str) -> Any:
            if text.lower() == "none" and type(None) in parts:
                return None
            try:
                if has_list and "," in text:
                    return [scalar(t) for t in text.split(",")]
                return scalar(text)
            except ValueError:  # argparse said "invalid convert value", not what is valid
                raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None

        return convert, None
    raise TypeError(f"no command-line parser for {hint!r}")


def add_override_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    section: str,
    exclude: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """Adds `--field-name` for every field of dataclass `cls` (bar `exclude`) in a group
    named `section`; given values are collected by `collect_overrides`. `defaults` names the
    values a subcommand uses instead of the field's own default (shown in the help); a field
    whose metadata says `"required": True` becomes a required flag."""
    group = parser.add_argument_group(section)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        convert, nargs = _parser(hints[f.name])
        flag = {"nargs": "?", "const": True} if hints[f.name] is bool else {"nargs": nargs}
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = (defaults or {}).get(f.name, default)
        note = f.metadata.get("help", "")
        required = f.metadata.get("required", False)
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"{section}.{f.name}",
            type=convert,
            **flag,
            default=argparse.SUPPRESS,
            required=required,
            metavar=f.name.upper(),
            help=f"{note} ({'required' if required else f'default: {default}'})".strip(),
        )


def fail(command: str, message: str) -> NoReturn:
    """Ends `linformer COMMAND` like argparse does on bad input: `linformer COMMAND: error:
    MESSAGE` on stderr and exit status 2 (the SystemExit also carries the message)."""
    text = f"linformer {command}: error: {message}"
    print(text, file=sys.stderr)
    error = SystemExit(text)
    error.code = USAGE_ERROR
    raise error


# Bad input: a wrong value, or a path that is missing, a file where a directory is wanted
# (--output-dir, --cache-dir) or the other way round (--out).
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    CheckpointWriteError,  # a full disk: one line naming the way on, not a traceback
)


def exit_on_user_error(run: Callable[[argparse.Namespace], None]) -> Callable:
    """Wraps a subcommand so bad input (`USER_ERRORS`) ends with its message and exit
    status 2 instead of a traceback."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> None:
        try:
            run(args)
        except USER_ERRORS as err:  # `linformer seq2seq train: error: ...`, as argparse says
            fail(" ".join(filter(None, (args.command, getattr(args, "action", None)))), str(err))

    return wrapper


def collect_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given on the command line, as {section: {field: value}}."""
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    return overrides
