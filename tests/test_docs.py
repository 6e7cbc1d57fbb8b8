"""The README and the pages under docs/ name files that exist, link to pages that exist, and the README
stays short. Generated study reports (docs/results*/, docs/bench/) are frozen records of their time and
are not checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "results-real" / "README.md"]
# a repository file written in the text: scripts/..., oar/..., tests/..., examples/..., configs/..., docs/... with an
# extension (names such as the metric oar/frac_scored have none)
PATH = re.compile(r"(?<![\w./-])((?:scripts|oar|tests|examples|configs|docs)/[\w./-]*\.[A-Za-z]+)(?![\w/])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _named(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page):
    missing = sorted(p for p in _named(page.read_text()) if not (ROOT / p).exists() and not (page.parent / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    links = [t.split("#")[0] for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]
    broken = sorted(t for t in links if t and not (page.parent / t).exists())
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_the_checks_catch_a_broken_name_and_link():
    assert _named("run `scripts/nope.py` and oar/grpo.py, see docs/x.md.") == {"scripts/nope.py", "oar/grpo.py", "docs/x.md"}
    assert LINK.findall("[a](docs/speed.md) and [b](https://x.org)") == ["docs/speed.md", "https://x.org"]


def test_the_readme_fits_on_a_few_screens_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 15_000, f"README.md is {len(text)} characters; move detail to docs/"
    linked = set(LINK.findall(text))
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"
    assert "python -m pytest -q" in text and "pip install -r requirements.txt && accelerate launch train.py" in text
