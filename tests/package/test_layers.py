"""The layer contract of oar/ (pyproject.toml's [tool.importlinter]) holds on the tree, and fails on
an import against it: a maths file that imports the training machinery, a lower layer that imports
a higher one, the built-in task that imports the sampler. import-linter reads a temporary copy of the
package, so the injected imports never touch the repository."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("importlinter") is None or not LINT.exists(),
    reason="import-linter is not installed (pip install -r requirements-dev.txt; CI installs it)",
)


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """lint-imports over the `oar` package found in `tree`, with the repository's contracts."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "oar", tmp_path / "oar", ignore=shutil.ignore_patterns("__pycache__", "tiny-arith"))
    return tmp_path


def test_the_tree_keeps_every_contract(tmp_path):
    out = _lint(_copy(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "module, line, arrow, broken",
    [
        (
            "gating.py",
            "from oar.training import config",
            "oar.gating -> oar.training.config",
            ["every import points down BROKEN", "plain tensors: no training machinery"],
        ),  # maths -> training
        (
            "rollout.py",
            "from oar import credit",
            "oar.rollout -> oar.credit",
            ["every import points down BROKEN", "independent (both read the rollout layout) BROKEN"],
        ),  # a circle
        (
            "tasks/arith.py",
            "from oar.sampler import format_prompt",
            "oar.tasks.arith -> oar.sampler",
            ["not the machinery BROKEN"],
        ),  # the built-in task -> sampling
        (
            "oar_grad.py",
            "import transformers",
            "oar.oar_grad -> transformers",
            ["plain tensors"],
        ),  # models through oar.lm only
    ],
)
def test_an_import_against_the_order_breaks_the_contract(tmp_path, module, line, arrow, broken):
    tree = _copy(tmp_path)
    path = tree / "oar" / module
    path.write_text(path.read_text() + f"\n{line}  # injected against the order\n")
    out = _lint(tree)
    report = " ".join(out.stdout.split())  # rich wraps long contract names
    assert out.returncode != 0, out.stdout
    assert arrow in report, out.stdout
    for words in broken:
        assert words in report, out.stdout
