"""The import graph keeps its layers (pyproject.toml's [tool.importlinter], run by import-linter's
`lint-imports`): nothing under harnessrl/ imports services, the four services never import each
other, and no two modules (or subpackages) of one package import each other, imports inside
functions and under TYPE_CHECKING included.

The second case plants each kind of fault in a copy of the packages and shows the contracts
catch it, so the first case cannot pass by checking nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_import_graph_keeps_its_layers() -> None:
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout, result.stdout


# (module to plant in, the import planted inside a function, the contract that must break)
PLANTED = [
    ("harnessrl/errors.py", "import services.store.redis_store",
     "harnessrl is below the services"),
    ("services/gateway/metrics.py", "import services.store.redis_store",
     "the four services never import each other"),
    ("services/gateway/rendezvous.py", "from services.gateway import app", "no import circles"),
]


@pytest.mark.parametrize("module,planted,contract", PLANTED, ids=["layer", "services", "circle"])
def test_a_planted_import_breaks_its_contract(tmp_path: Path, module: str, planted: str,
                                             contract: str) -> None:
    for package in ("harnessrl", "services"):
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n    {planted}\n")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), result.stdout
