"""Test files take shared builders from `testing_utils`, never from `conftest`: pytest imports conftest
on its own terms (its module name, and whether it is importable at all, depend on the import mode), and
conftest holds only fixtures and session settings."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_test_file_imports_conftest():
    importers = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if "conftest" in _imported_modules(p))
    assert importers == []


def test_conftest_defines_only_fixtures():
    """Every function conftest.py defines is a pytest fixture; builders belong in testing_utils.py."""
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    plain = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and not any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
    ]
    assert plain == []


def test_the_check_sees_an_import_of_conftest(tmp_path):
    """The scan above finds both forms, also inside a function."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from conftest import perturbed\n\nimport conftest\n", encoding="utf-8")
    assert _imported_modules(sample) == {"conftest"}
    sample.write_text("from testing_utils import perturbed\n", encoding="utf-8")
    assert "conftest" not in _imported_modules(sample)
