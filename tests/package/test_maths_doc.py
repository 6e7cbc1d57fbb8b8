"""docs/maths.md is what the code cites: every "maths §N" written anywhere in the repository is a heading
there, and every function it (or the README's paper-to-function map) names, as a backticked dotted name
`oar.module.name`, imports and is defined in that module."""

import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATHS = ROOT / "docs" / "maths.md"
# where citations live: the package, the entry points, scripts, tests, pages and the research notebook
SOURCES = ["README.md", "train.py", "eval.py", "oar", "scripts", "tests", "docs", "examples", "research"]
# "maths §5", "maths §1.4", "maths §3-5", "maths §3, §4", "maths §2 and §3"
CITATION = re.compile(r"maths (§\d+(?:\.\d+)?(?:\s*(?:,|-|–|and)\s*§?\d+(?:\.\d+)?)*)")
HEADING = re.compile(r"^#+\s+§(\d+(?:\.\d+)?)\s", re.MULTILINE)
NAME = re.compile(r"`(oar(?:\.\w+)+)`")


def _files():
    for entry in SOURCES:
        path = ROOT / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (
                p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".md") and p.stat().st_size < 1_000_000
            )


def cited(text: str) -> set[str]:
    """Section numbers a text cites; a range §3-5 cites 3, 4 and 5."""
    out = set()
    for m in CITATION.finditer(text):
        refs = re.findall(r"\d+(?:\.\d+)?", m.group(1))
        out.update(refs)
        for lo, hi in re.findall(r"§?(\d+)\s*[-–]\s*§?(\d+)(?![.\d])", m.group(1)):
            out.update(str(n) for n in range(int(lo), int(hi) + 1))
    return out


def resolve(dotted: str):
    """The object a dotted name `oar.x.y` names: the longest importable module prefix, then attributes.
    A function or class must be named where it is defined, not where another module imports it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the name does not exist
        home = ".".join(parts[:cut])
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ != home:
            raise AttributeError(f"{dotted} is defined in {obj.__module__}, not {home}: name it there")
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_cited_section_is_a_heading_of_maths_md():
    sections = set(HEADING.findall(MATHS.read_text()))
    missing = {}
    for path in _files():
        for n in cited(path.read_text(errors="replace")) - sections:
            missing.setdefault(f"maths §{n}", []).append(str(path.relative_to(ROOT)))
    assert not missing, (
        f"cited sections that docs/maths.md does not have (its headings: {sorted(sections)}): {missing}"
    )


def test_nothing_cites_the_maths_outside_the_repository():
    """The code once cited a specification kept beside the repository, which no clone has."""
    old = re.compile("SPEC" + r"(?: §|\.md|'s)")  # built, so that this file does not match itself
    left = sorted(str(p.relative_to(ROOT)) for p in _files() if old.search(p.read_text(errors="replace")))
    assert not left, f"files that still cite SPEC instead of docs/maths.md: {left}"


def test_every_function_maths_md_and_the_readme_name_exists():
    names = sorted(set(NAME.findall(MATHS.read_text())))
    assert len(names) >= 20, names  # the page names an implementation for each equation
    names += sorted(set(NAME.findall((ROOT / "README.md").read_text())) - set(names))  # its paper-to-function map
    broken = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as err:
            broken.append(f"{name} ({type(err).__name__}: {err})")
    assert not broken, f"docs/maths.md or README.md names what does not exist: {broken}"


def test_the_checks_catch_a_missing_section_and_a_missing_function():
    assert cited("see maths §5 and maths §1.4; maths §3-5, maths §2, §6") == {"5", "1.4", "3", "4", "2", "6"}
    assert cited("the " + "SPEC" + " §5 of old, maths§5") == set()
    absent = "maths §" + "99"  # built, so that this file does not cite it
    assert "99" in cited(absent) - set(HEADING.findall(MATHS.read_text()))
    assert HEADING.findall("## §5 Gating\n### §5.1 Steps\n#§6 no\n") == ["5", "5.1"]
    assert resolve("oar.gating.bilevel_weights").__name__ == "bilevel_weights"
    for bad in ("oar.gating.no_such_function", "oar.no_such_module.f", "oar.credit_methods.bilevel_weights"):
        try:
            resolve(bad)
        except (ImportError, AttributeError):
            continue
        raise AssertionError(f"{bad} resolved")
