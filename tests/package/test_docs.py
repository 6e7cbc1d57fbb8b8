"""The README, the pages under docs/ and the lab notebook's index (research/README.md) name files that
exist, link to pages that exist, and name commands that run; the README stays short. Generated study
reports (research/*/ but the real-model study's page, docs/bench/) are frozen records of their time and
are not checked."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "research" / "README.md"
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    RESEARCH,
    ROOT / "research" / "real_smollm2" / "README.md",
]
# a repository file written in the text: scripts/..., oar/..., tests/..., examples/..., configs/..., docs/...,
# research/... with an extension (names such as the metric oar/frac_scored have none)
PATH = re.compile(r"(?<![\w./-])((?:scripts|oar|tests|examples|configs|docs|research)/[\w./-]*\.[A-Za-z]+)(?![\w/])")
# a command in a fenced block: `python path/to/script.py ...` (after any VAR=value prefix)
COMMAND = re.compile(r"^(?:\w+=\S+\s+)*python\s+([\w./-]+\.py)\b", re.MULTILINE)
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
    assert _named("run `scripts/nope.py` and oar/grpo.py, see docs/x.md.") == {
        "scripts/nope.py",
        "oar/grpo.py",
        "docs/x.md",
    }
    assert LINK.findall("[a](docs/speed.md) and [b](https://x.org)") == ["docs/speed.md", "https://x.org"]


def test_the_readme_is_a_front_page_and_the_docs_index_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 6_000, f"README.md is {len(text.encode())} bytes; move detail to docs/"
    assert "docs/README.md" in set(LINK.findall(text))  # the index of the pages
    linked = set(LINK.findall((ROOT / "docs" / "README.md").read_text()))
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and p.name not in linked]
    assert not unlinked, f"docs/README.md does not link {unlinked}"
    assert "pip install -r requirements.txt" in text


def quick_start() -> list[str]:
    """The README's quick-start commands, one a line, without their comments."""
    block = re.search(r"## Quick start\n+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_the_quick_start_installs_for_a_cpu_and_runs_the_30_second_command_first():
    """Issue 54: a CPU-only user is told how to get torch's CPU build, in one line, before the install that
    would pull the CUDA build; the 30-second first command comes before the 15-minute default run, in its own
    --output_dir (a run refuses a folder holding another run's checkpoints, so the two would collide)."""
    lines = quick_start()
    assert lines[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu", lines
    first = next(i for i, line in enumerate(lines) if "python train.py --steps 3 --eval_size 50" in line)
    default = lines.index("accelerate launch train.py")
    assert 0 < first < default and lines[first].startswith("pip install -r requirements.txt && "), lines
    assert "--output_dir" in lines[first].split("&&")[-1], lines[first]


def test_ci_runs_the_readmes_test_command_exactly():
    """.ci/run runs the quick start's second command, as it is written there (the vLLM run comes after it)."""
    command = quick_start()[-1]
    assert command.startswith("python -m pytest"), command
    assert command in (ROOT / ".ci" / "run").read_text().splitlines(), f".ci/run does not run {command!r}"


def _commands(text: str) -> list[str]:
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, re.DOTALL)
    return sorted({m.group(1) for block in blocks for m in COMMAND.finditer(block)})


@pytest.mark.slow  # each --help imports torch: 10-25 s a script on 2 shared cores
def test_every_study_in_the_notebook_names_a_page_and_commands_that_run():
    import subprocess
    import sys

    text = RESEARCH.read_text()
    studies = [
        d.name for d in sorted((ROOT / "research").iterdir()) if d.is_dir() and d.name not in ("common", "__pycache__")
    ]
    unlisted = [s for s in studies if f"`{s}/`" not in text]
    assert not unlisted, f"research/README.md has no section for {unlisted}"
    scripts = _commands(text)
    assert len(scripts) >= 5, scripts
    failed = {}
    for script in scripts:
        proc = subprocess.run(
            [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )
        if proc.returncode != 0:
            failed[script] = proc.stderr[-500:]
    assert not failed, f"research/README.md's commands whose --help fails: {failed}"


def test_the_command_finder_reads_fenced_blocks_only():
    text = "run `python a.py`\n```bash\nOMP_NUM_THREADS=1 python research/x/y.py --n 2\npython z.py   # note\n```\n"
    assert _commands(text) == ["research/x/y.py", "z.py"]


def test_the_code_cites_docs_pages_not_a_tracker():
    """Comments and docstrings of oar/, train.py and eval.py point at docs pages: the issue tracker is not in the
    repository, so "issue 52" tells a reader nothing."""
    sources = [ROOT / "train.py", ROOT / "eval.py", *sorted((ROOT / "oar").rglob("*.py"))]
    cited = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line)
    ]
    assert not cited, f"cite a docs page instead of an issue number: {cited}"
