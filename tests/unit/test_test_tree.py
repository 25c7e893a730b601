"""The test tree's own layout: shared code lives in tests/helpers, written once.

A conftest holds fixtures and hooks only, so no module imports one; helpers import no test
module; and the one fake gpu-worker (a ROUTER speaking the wire) is tests/helpers/fake_worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parents[1]
TEST_DIRS = ("unit", "integration", "e2e", "kernels", "deploy")


def _imported_modules(path: Path) -> list[str]:
    modules: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.append(node.module)
    return modules


def _sources() -> list[Path]:
    return sorted(path for path in TESTS.rglob("*.py") if "data" not in path.parts)


def test_no_module_imports_a_conftest() -> None:
    offenders = [
        f"{path.relative_to(TESTS)} imports {module}"
        for path in _sources()
        for module in _imported_modules(path)
        if module == "conftest" or module.endswith(".conftest")
    ]
    assert offenders == [], "move what they import to tests/helpers"


def test_helpers_import_no_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS)} imports {module}"
        for path in sorted((TESTS / "helpers").glob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[:2] in [["tests", name] for name in TEST_DIRS]
    ]
    assert offenders == []


def _opens_a_router(path: Path) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "ROUTER"
        and isinstance(node.value, ast.Name)
        and node.value.id == "zmq"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
    )


def test_the_only_fake_worker_is_the_helper() -> None:
    routers = [
        str(path.relative_to(TESTS))
        for path in _sources()
        if path.parent.name != "helpers" and _opens_a_router(path)
    ]
    assert routers == [], "use tests/helpers/fake_worker.FakeWorker"
