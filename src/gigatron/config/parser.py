"""`FlagParser`: argparse with one-line errors and a "did you mean" for mistyped flags.

argparse answers a mistyped flag with the whole usage (hundreds of lines for `pretrain`) and no
hint; this parser prints one line naming the unknown flag, the closest known flags and where to
see them all, and exits with status 2 as argparse does.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gigatron.errors import GigatronError

_UNRECOGNIZED = "unrecognized arguments: "


def closest_flags(unknown: str, known: list[str], count: int = 3) -> list[str]:
    """The known flags nearest to `unknown` (its `=value` part ignored), best first."""
    name = unknown.split("=", 1)[0]
    return difflib.get_close_matches(name, known, n=count, cutoff=0.6)


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (with suggestions for unknown flags)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def known_flags(self) -> list[str]:
        return [flag for action in self._actions for flag in action.option_strings]

    def unknown_flag_message(self, arguments: list[str]) -> str:
        """'--foo: unknown flag; did you mean --bar?' for each flag among `arguments`."""
        flags = [a for a in arguments if a.startswith("-")] or arguments
        parts = []
        for flag in flags:
            close = closest_flags(flag, self.known_flags())
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            parts.append(f"{flag}: unknown flag{hint}")
        return f"{'; '.join(parts)} (`{self.prog} --help` lists every flag)"

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        # Unknown flags are named before missing required ones: a mistyped flag is the likelier
        # mistake, and argparse would otherwise report only what is missing.
        argv = list(sys.argv[1:] if args is None else args)
        known = set(self.known_flags())
        unknown = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
        if unknown and "--" not in argv:
            self.error(_UNRECOGNIZED + " ".join(unknown))
        return super().parse_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            message = self.unknown_flag_message(message[len(_UNRECOGNIZED) :].split())
        else:
            message = f"{message} (`{self.prog} --help` lists every flag)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def command_parser(name: str, description: str, **kwargs) -> FlagParser:
    """The parser of `gigatron <name>`: one-line errors, no abbreviations, every default shown."""
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    return FlagParser(prog=f"gigatron {name}", description=description, **kwargs)


def run_subcommand(
    command: str,
    steps: dict[str, tuple[str, Callable[[FlagParser], None], Callable[..., Any]]],
    argv: Sequence[str],
) -> Any:
    """`gigatron <command> <step> [flags]`: `steps` maps each step to (what it does, the function
    adding its flags, the function running the parsed flags). No step or `--help` lists them."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(len(name) for name in steps)
        lines = [f"usage: gigatron {command} <step> [flags]   (gigatron {command} <step> --help)"]
        lines += ["", "steps:", *(f"  {n:<{width}}  {s}" for n, (s, _, _) in steps.items())]
        print("\n".join(lines))
        raise SystemExit(0 if argv else 2)  # as argparse ends a help or a missing argument
    if argv[0] not in steps:
        raise GigatronError(f"{command} {argv[0]}: unknown step; choose one of {', '.join(steps)}")
    summary, add_flags, run = steps[argv[0]]
    parser = command_parser(f"{command} {argv[0]}", summary)
    add_flags(parser)
    return run(parser.parse_args(argv[1:]))
