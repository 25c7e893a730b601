"""bench/'s layout, checked: scripts run as `python -m bench.<name>` and import only library
modules (bench.common, bench.offline, bench.serving's), by their package names.

A script is a module with `if __name__ == "__main__"`. Importing one from another module,
by `bench.` or as a top-level name the way `python bench/x.py` allowed, ties two command
lines together (bench/engine.py once imported speculative.py, which imported it back); the
reusable part belongs in a library module. Modules stay readable in one sitting.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(BENCH.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_script(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in tree.body
    )


SCRIPTS = {name for name, tree in TREES.items() if _is_script(tree)}
# What `python bench/<x>.py` made importable as a top-level name: a module beside the script
# (not the repository's own packages, such as `kernels`, which bench/kernels.py imports).
PACKAGES = {path.parent.name for path in ROOT.glob("*/__init__.py")}
TOP_LEVEL_NAMES = {path.stem for path in BENCH.rglob("*.py")} - {"__init__"} - PACKAGES


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_no_bench_module_imports_a_script_or_bench_by_a_top_level_name() -> None:
    wrong = []
    for name, tree in TREES.items():
        for line, imported in _imports(tree):
            where = f"{MODULES[name].relative_to(ROOT)}:{line} imports {imported}"
            if imported in SCRIPTS:
                wrong.append(f"{where}, a script: move what it needs to a library module")
            elif imported.split(".")[0] in TOP_LEVEL_NAMES:
                wrong.append(f"{where}: name it bench.<package>.<module>")
    assert not wrong, "\n".join(wrong)


def test_no_bench_module_touches_sys_path() -> None:
    wrong = [str(path) for path in MODULES.values() if "sys.path" in path.read_text()]
    assert not wrong, f"scripts run as python -m bench.<name>: {wrong}"


def test_every_bench_module_is_at_most_450_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"split these by concern: {over}"


def test_every_script_named_in_the_device_check_is_a_bench_module() -> None:
    for shell in ("gpu_check.sh", "gpu_prepare.sh"):
        text = (BENCH / shell).read_text()
        named = set(re.findall(r"-m (bench\.[\w.]+)", text))
        assert named, shell
        assert named <= SCRIPTS, f"{shell} runs {sorted(named - SCRIPTS)}, not a bench script"
