"""The package installs (a newcomer's report: `pip install -e .` failed with "Multiple top-level packages discovered in
a flat-layout", so `import oar` worked only from the repository's root): pyproject.toml names oar/ as the one
package, with tiny-arith's weights as its data."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path) -> Path:
    """What packaging reads, copied (a build writes oar.egg-info/ and build/ beside pyproject.toml)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "oar", src / "oar", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def test_a_wheel_holds_the_package_and_the_built_in_policy_only(tmp_path):
    src = _copy(tmp_path)
    wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src)]
    proc = subprocess.run([*wheel, "-w", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("oar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "oar/training/run.py" in names and "oar/tasks/tiny-arith/model.safetensors" in names
    assert {n.split("/")[0] for n in names} == {"oar", wheel.name.split("-py3")[0] + ".dist-info"}


@pytest.mark.slow  # a fresh venv and an editable install: ~15 s
def test_pip_install_e_makes_oar_importable_from_anywhere(tmp_path):
    src = _copy(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "-e", str(src)],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0 and "setuptools" in pip.stderr and "No matching distribution" in pip.stderr:
        pytest.skip("no package index reachable for the build backend (setuptools)")
    assert pip.returncode == 0, pip.stderr[-3000:]
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import oar; print(oar.__file__)"],
        cwd=tmp_path,  # not the source folder: the install, not the working directory, finds it
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0 and Path(where.stdout.strip()) == src / "oar" / "__init__.py", where
