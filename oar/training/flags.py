"""A command line built from a settings dataclass: one flag per field, its help the field's docstring,
grouped, with the ecosystem's names as aliases; every error one line that names the flag.

Plain argparse, not transformers' HfArgumentParser: this module imports nothing heavy, so `--help`
and a mistyped flag answer before torch loads (a fraction of a second, not ten), and argparse gives
the groups and aliases directly.

    parser = FlagParser(Config, prog="train.py", titles=TITLES, aliases=ALIASES)
    cfg = parser.parse(sys.argv[1:])          # a Config, or exit 2 with "train.py: error: ..."

A field's help is the string literal under it in its class (the attribute docstring, read from the
source with `ast`), so a setting's meaning is written once, beside its default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Alias:
    """Another name of a flag. `values` maps the other name's values to this project's (a value not in
    it is refused, naming both); `also` names fields the alias also sets unless they are given
    themselves (TRL's --epsilon sets both clip bounds)."""

    name: str  # the other name, without dashes
    target: str  # the field it sets
    origin: str = "TRL's name"  # where the name comes from, for --help
    values: dict | None = None
    other_values: bool = False  # values not in `values` pass through unchanged (else they are refused)
    also: tuple[str, ...] = ()
    note: str = ""


def field_docs(cls) -> dict[str, str]:
    """{field name: its docstring, whitespace folded} for `cls` and its dataclass bases."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (frozen application): no help text, flags still work
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "yes", "1", "on"):
        return True
    if low in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value: {text!r} (true or false)")


def _typed(kind: type, name: str) -> Callable[[str], object]:
    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


class _OneLine(argparse.ArgumentParser):
    """argparse that stops with one line, `prog: error: message`, exit status 2, no usage block."""

    unmapped: dict[str, str] = {}
    gone: dict[str, str] = {}

    def error(self, message: str):
        close = re.match(r"unrecognized arguments: --(?:no_)?([^\s=]+)", message)
        name = close.group(1) if close else None
        if name in self.gone:  # a former flag: where its setting went
            message = f"--{name} is no longer a flag: {self.gone[name]} (docs/flags.md)"
        elif name in self.unmapped:  # another library's flag with no equivalent: say why
            message = f"--{name} is not a flag here: {self.unmapped[name]} (docs/flags.md)"
        elif close:  # a flag of another library: say what is near, and where the mapping is
            # a close spelling only: difflib's default cutoff (0.6) offered --seed for --deepspeed
            flags = [o for a in self._actions for o in a.option_strings]
            near = difflib.get_close_matches(f"--{close.group(1)}", flags, n=1, cutoff=0.8)
            message += f" (did you mean {near[0]}?" if near else " ("
            message += (" " if near else "") + "every flag: --help; other libraries' names: docs/flags.md)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _show(value) -> str:
    return repr(value) if value == "" else str(value)


class FlagParser:
    """The command line of `cls` (a dataclass whose every field has a default of type int, float, str or bool).

    A field is shown in --help under the TITLE of the class that declares it (`shown_in` names the few shown
    elsewhere), the groups in the order of `titles`; `aliases` are other libraries' names; `unmapped` and `gone`
    map a name that is not a flag (another library's, or a former flag) to the line that says why."""

    def __init__(
        self,
        cls,
        *,
        prog: str,
        description: str = "",
        titles: tuple[str, ...] = (),
        shown_in: dict[str, str] | None = None,
        aliases: tuple[Alias, ...] = (),
        unmapped: dict[str, str] | None = None,
        gone: dict[str, str] | None = None,
    ):
        self.cls, self.prog = cls, prog
        self.fields = {f.name: f for f in dataclasses.fields(cls)}
        self.docs = field_docs(cls)
        self.aliases = {a.name: a for a in aliases}
        assert all(a.target in self.fields for a in aliases), [a.name for a in aliases if a.target not in self.fields]
        self.parser = _OneLine(
            prog=prog,
            description=description,
            allow_abbrev=False,
            usage=f"{prog} [--flag value ...]",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.parser.unmapped = dict(unmapped or {})
        self.parser.gone = dict(gone or {})
        groups = self.groups(titles, shown_in or {})
        for title, names in groups.items():
            group = self.parser.add_argument_group(title)
            for name in names:
                self._add(group, name)

    def groups(self, titles: tuple[str, ...], shown_in: dict[str, str]) -> dict[str, list[str]]:
        """{title: field names}: each field under its `shown_in` title or its declaring class's TITLE."""
        assert set(shown_in) <= set(self.fields), set(shown_in) - set(self.fields)
        out: dict[str, list[str]] = {t: [] for t in titles}
        for name in self.fields:
            home = next(k for k in reversed(self.cls.__mro__) if name in getattr(k, "__annotations__", {}))
            out.setdefault(shown_in.get(name) or getattr(home, "TITLE", "settings"), []).append(name)
        return {t: names for t, names in out.items() if names}

    def _add(self, group, name: str) -> None:
        f = self.fields[name]
        kind, default = type(f.default), f.default
        others = [a for a in self.aliases.values() if a.target == name]
        spelled = [f"--{name}"] + [f"--{a.name}" for a in others]
        doc = self.docs.get(name) or f.metadata.get("help", "")  # the docstring; a field(metadata=...) help otherwise
        also = "; ".join(f"--{a.name}: {a.origin}" + (f", {a.note}" if a.note else "") for a in others)
        if kind is bool:
            help_text = f"{doc} (default: {'on' if default else 'off'}; --no_{name} turns it off)"
            group.add_argument(
                *spelled,
                dest=name,
                nargs="?",
                const=True,
                default=None,
                type=_bool,
                metavar="BOOL",
                help=help_text + (f" [{also}]" if also else ""),
            )
            group.add_argument(f"--no_{name}", dest=name, action="store_false", default=None, help=argparse.SUPPRESS)
            return
        assert kind in (int, float, str), f"{name}: a flag of type {kind.__name__}"
        plain = [a for a in others if not a.values]
        mapped = [a for a in others if a.values]
        group.add_argument(
            f"--{name}",
            *[f"--{a.name}" for a in plain],
            dest=name,
            default=None,
            type=_typed(kind, name),
            metavar=name.upper(),
            help=f"{doc} (default: {_show(default)})" + (f" [{also}]" if also else ""),
        )
        for a in mapped:  # a name whose values are spelled otherwise: its own option, mapped after parsing
            group.add_argument(
                f"--{a.name}", dest=f"alias:{a.name}", default=None, metavar=a.name.upper(), help=argparse.SUPPRESS
            )

    def parse(self, argv: list[str]):
        """A `cls` from `argv`; on a bad flag or value: one line on stderr and exit status 2."""
        args = vars(self.parser.parse_args(argv))
        for name in self.fields:  # one setting under two of its names: which one was meant is a guess, so neither
            used = [s for s in self.spellings(name) if any(tok == s or tok.startswith(f"{s}=") for tok in argv)]
            if len(used) > 1:
                self.parser.error(f"argument {used[1]}: sets what {used[0]} sets; give one of them")
        given = {k: v for k, v in args.items() if v is not None and not k.startswith("alias:")}
        for key, value in args.items():
            if not key.startswith("alias:") or value is None:
                continue
            a = self.aliases[key.removeprefix("alias:")]
            if value not in a.values and not a.other_values:
                choices = ", ".join(f"{k} (= --{a.target} {v})" for k, v in a.values.items())
                self.parser.error(f"argument --{a.name}: {value!r} has no equivalent here; choose one of {choices}")
            value = a.values.get(value, value)
            if a.target in given and given[a.target] != value:
                self.parser.error(f"argument --{a.name}: conflicts with --{a.target} {given[a.target]}")
            given[a.target] = value
        for a in self.aliases.values():  # --epsilon also sets --clip_high, unless that is given itself
            used = any(tok == f"--{a.name}" or tok.startswith(f"--{a.name}=") for tok in argv)
            if used and a.also:
                spelled = {o for f in a.also for o in self.spellings(f)}
                for target in a.also:
                    if not any(tok.split("=")[0] in spelled for tok in argv):
                        given[target] = given[a.target]
        return self.cls(**given)

    def spellings(self, name: str) -> list[str]:
        """Every flag that sets field `name`."""
        return [f"--{name}"] + [f"--{a.name}" for a in self.aliases.values() if a.target == name]

    def as_typed(self, message: str, argv: list[str]) -> str:
        """`message` with each flag named as the user typed it (--num_generations, not --group_size)."""
        for a in self.aliases.values():
            if any(tok == f"--{a.name}" or tok.startswith(f"--{a.name}=") for tok in argv):
                message = re.sub(rf"--{re.escape(a.target)}\b", f"--{a.name}", message)
        return message

    def format_help(self) -> str:
        return self.parser.format_help()
