"""The generic part of the command line: environment variables, a TOML file, shown defaults.

:class:`Parser` is an :class:`argparse.ArgumentParser` whose every option, whoever added
it and in whichever sub-command, also reads

* an environment variable: ``RTTS_<DEST>`` for ``rtts serve`` (and ``rtts worker``, which
  is ``serve`` with a job worker) and the global options
  (``--max-queue`` -> ``RTTS_MAX_QUEUE``), ``RTTS_<COMMAND>_<DEST>`` for the other commands
  (``rtts bench chattts --tokens`` -> ``RTTS_BENCH_CHATTTS_TOKENS``); a few options keep
  their historical name (:data:`ENV_NAMES`);
* a key of a TOML file given with ``--config FILE`` (or ``RTTS_CONFIG``): top-level keys
  for the global options, a ``[serve]`` table for ``rtts serve``, ``[bench.chattts]`` for
  ``rtts bench chattts``; keys are the flag names (``max-queue`` or ``max_queue``).

A flag on the command line wins over the environment, the environment over the file, the
file over the built-in default. Values from the environment and the file go through the
option's own ``type`` and ``choices``, so a bad one is a one-line error and exit status 2,
like a bad flag. ``--help`` shows each option's default and variable. Sub-commands are
created with the same class (argparse's ``add_subparsers`` uses the parent's class), so a
flag added anywhere with a plain ``add_argument`` gets all this without further code.
"""

from __future__ import annotations

import argparse
import contextvars
import os
import sys
import textwrap
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["ENV_NAMES", "Parser", "env_name", "is_secret", "option_actions"]

# dest -> variable, where the variable existed before the generic rule
ENV_NAMES = {"api_key": "RTTS_API_KEYS"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# Options whose values must never be echoed (help defaults, error messages).
_SECRET_WORDS = ("secret", "password", "api_key", "token_secret", "admin_key")


def is_secret(action: argparse.Action) -> bool:
    return any(word in action.dest for word in _SECRET_WORDS)


# The TOML file being applied during one parse_args call (set by the top-level parser,
# read by the sub-command parsers argparse invokes from inside it).
_FILE: contextvars.ContextVar[tuple[str, dict[str, Any]] | None] = contextvars.ContextVar(
    "rtts_cli_config", default=None)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written; adds each option's default and variable to its help.

    Options without a metavar of their own show a short one (N for a count, NUM for a
    number, PATH for a file or directory, VALUE otherwise) instead of the upper-cased
    destination, so that most flags and their help share a line at 80 columns.
    """

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        if action.type is int:
            return "N"
        if action.type is float:
            return "NUM"
        if any(w in action.dest for w in ("dir", "file", "path", "model")):
            return "PATH"
        return "VALUE"

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        env = getattr(action, "rtts_env", None)
        if env is None:
            return text
        extra = [f"env {env}"]
        # One default per flag: a help text that states its own default keeps it.
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) \
                and "%(default)" not in text and "default" not in text.lower() \
                and action.default is not argparse.SUPPRESS:
            default = action.default
            if default is None or default == []:
                extra.insert(0, "default: none")
            elif is_secret(action):
                extra.insert(0, "default: set, not shown")
            else:
                extra.insert(0, "default: %(default)s")
        return f"{text} [{'; '.join(extra)}]" if text else f"[{'; '.join(extra)}]"


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options (not positionals, help, version or sub-commands) of one parser."""
    return [a for a in parser._actions
            if a.option_strings and a.dest not in ("help", "config")
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                   argparse._SubParsersAction))]


def env_name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The environment variable of one option (see the module docstring)."""
    words = parser.prog.split()[1:]
    # `rtts worker` is `rtts serve` with a job worker: the same flags, the same variables
    # (a worker given RTTS_CACHE_REDIS must share the instances' cache, not ignore it)
    if words in (["serve"], ["worker"]) or not words:
        prefix = "RTTS_"
        if action.dest in ENV_NAMES:
            return ENV_NAMES[action.dest]
    else:
        prefix = "RTTS_" + "_".join(w.upper().replace("-", "_") for w in words) + "_"
    return prefix + action.dest.upper()


class Parser(argparse.ArgumentParser):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    # -- errors: one line, exit 2 ---------------------------------------------------------

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    # -- annotation ---------------------------------------------------------------------

    def _annotate(self) -> None:
        for action in option_actions(self):
            if getattr(action, "rtts_env", None) is None:
                action.rtts_env = env_name(self, action)  # type: ignore[attr-defined]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                action.required = False  # checked below, with a clearer message

    def format_help(self) -> str:
        self._annotate()
        words = self.prog.split()[1:]
        if words and self.epilog is None and option_actions(self):
            table = ".".join(words)
            text = (f"Each option also reads the variable shown and the key of its name in "
                    f"the [{table}] table of a TOML file given with `rtts --config FILE "
                    f"{' '.join(words)}` (or `{self.prog} --config FILE`, or RTTS_CONFIG). A "
                    "flag wins over the variable, the variable over the file.")
            self.epilog = textwrap.fill(text, width=88, break_on_hyphens=False)
        return super().format_help()

    # -- parsing --------------------------------------------------------------------------

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        self._annotate()
        argv = list(sys.argv[1:] if args is None else args)
        token = None
        path: str | None = None
        if _FILE.get() is None:  # the top-level call: find --config before anything else
            argv, path = _take_config(argv)
            path = path or os.environ.get("RTTS_CONFIG") or None
            if path is not None:
                token = _FILE.set((path, self._read_file(path)))
        saved: list[tuple[argparse.Action, Any, bool]] = []
        try:
            for action, value in self._external_values():
                saved.append((action, action.default, action.required))
                action.default, action.required = value, False
            ns, rest = super().parse_known_args(argv, namespace)
        finally:
            for action, default, required in saved:
                action.default, action.required = default, required
            if token is not None:
                _FILE.reset(token)
        if path is not None:
            ns.config = Path(path)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) \
                    and getattr(ns, action.dest, None) is None:
                self.error(f"missing command: choose one of {', '.join(action.choices)}")
        return ns, rest

    def _read_file(self, path: str) -> dict[str, Any]:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            self.error(f"--config {path}: {exc.strerror or exc}")
        except tomllib.TOMLDecodeError as exc:
            self.error(f"--config {path}: not valid TOML: {exc}")
        return data

    def _file_table(self) -> tuple[str, dict[str, Any]] | None:
        """This parser's table of the TOML file (top level for the top-level parser)."""
        current = _FILE.get()
        if current is None:
            return None
        path, table = current
        for word in self.prog.split()[1:]:
            sub = table.get(word)
            if not isinstance(sub, dict):
                return None
            table = sub
        return path, table

    def _external_values(self) -> list[tuple[argparse.Action, Any]]:
        """(action, value) for the options the environment or the file sets."""
        by_key: dict[str, argparse.Action] = {}
        for action in option_actions(self):
            for opt in action.option_strings:
                if opt.startswith("--"):
                    by_key[opt[2:]] = action
                    by_key[opt[2:].replace("-", "_")] = action
        chosen: dict[int, tuple[argparse.Action, Any]] = {}
        found = self._file_table()
        if found is not None:
            path, table = found
            for key, raw in table.items():
                if isinstance(raw, dict):
                    continue  # a sub-command's table
                known = by_key.get(key)
                if known is None:
                    self.error(f"{path}: unknown setting {key!r} for `{self.prog}`")
                value = self._coerce(known, raw, f"{path}: {key}")
                if _negates(known, key):  # `no-cache = true` in the file: --no-cache given
                    value = not value
                chosen[id(known)] = (known, value)
        for action in option_actions(self):
            env = getattr(action, "rtts_env", None)
            if env is not None and env in os.environ:
                raw = os.environ[env]
                origin = env if is_secret(action) else f"{env}={raw!r}"
                chosen[id(action)] = (action, self._coerce(action, raw, origin))
        return list(chosen.values())

    def _coerce(self, action: argparse.Action, raw: Any, origin: str) -> Any:
        """A value from the environment (a string) or the file (TOML types) as the option
        would have parsed it; errors name where it came from."""
        if isinstance(action, argparse._CountAction):
            try:
                return int(raw)
            except (TypeError, ValueError):
                self.error(f"{origin}: expected a count")
        if action.nargs == 0:  # a switch: the value names the option's own setting
            if isinstance(raw, bool):
                flag = raw
            elif (word := str(raw).strip().lower()) in _TRUE | _FALSE:
                flag = word in _TRUE
            else:
                self.error(f"{origin}: expected true or false")
            if isinstance(action, argparse._StoreConstAction) and not isinstance(
                    action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                return action.const if flag else action.default
            return flag
        many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") \
            or (isinstance(action.nargs, int) and action.nargs > 1)
        if many:
            items = raw if isinstance(raw, list) else [
                p.strip() for p in str(raw).split(",") if p.strip()]
            return [self._one(action, item, origin) for item in items]
        return self._one(action, raw, origin)

    def _one(self, action: argparse.Action, raw: Any, origin: str) -> Any:
        if isinstance(raw, (list, dict)):
            self.error(f"{origin}: expected a single value")
        text = raw if isinstance(raw, str) else str(raw).lower() if isinstance(raw, bool) \
            else str(raw)
        convert: Any = action.type or str
        try:
            value = convert(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            name = getattr(convert, "__name__", "value")
            self.error(f"{origin}: invalid {name} value ({exc})" if isinstance(
                exc, argparse.ArgumentTypeError) else f"{origin}: invalid {name} value")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            self.error(f"{origin}: invalid choice {value!r} (choose from {choices})")
        return value


def _negates(action: argparse.Action, key: str) -> bool:
    """A file key naming a switch that turns its setting off (``--no-cache``, the ``--no-``
    form of ``--color/--no-color``): its value says whether the switch is given, so the
    setting is the opposite. Environment variables are named after the setting (its dest),
    so they never negate."""
    if isinstance(action, argparse._StoreFalseAction):
        return True
    return isinstance(action, argparse.BooleanOptionalAction) \
        and key.replace("_", "-").startswith("no-")


def _take_config(argv: list[str]) -> tuple[list[str], str | None]:
    """Remove ``--config FILE`` / ``--config=FILE`` from anywhere in argv (it may follow
    the sub-command); the last one wins."""
    out: list[str] = []
    path: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    return out, path
