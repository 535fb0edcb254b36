"""setup.cfg ships every folder of the package: a wheel build names each folder holding Python files as a
package (setuptools warns "Package ... is absent from the `packages` configuration" and would drop it
otherwise), and nothing outside the package."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_folder_with_python_files_is_a_listed_package(monkeypatch):
    setupcfg = pytest.importorskip("setuptools.config.setupcfg")
    monkeypatch.chdir(ROOT)  # setup.cfg's paths are relative to the project root
    listed = set(setupcfg.read_configuration("setup.cfg")["options"]["packages"])
    src = ROOT / "src"
    folders = {".".join(path.parent.relative_to(src).parts) for path in (src / "hf_featcal").rglob("*.py")}
    assert listed == folders
