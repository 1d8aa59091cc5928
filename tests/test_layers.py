"""The layers import one way: gem <- experiments <- analysis <- paper_figures. An import of a higher layer from a
lower one, at module level or inside a function, is a circle Python would not notice (the function-local import
runs late), and it makes the lower layer unusable without the higher one.

The tests too: what test modules share lives in tests/helpers, and no file under tests/ imports a test module or
conftest (pytest's to load, under a name its import mode chooses; a test module imported by another runs its
module-level code, and its fixtures, in the importer)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
LAYERS = ["gem", "experiments", "analysis", "paper_figures"]


def imported_packages(path: Path):
    """(line, top-level package) of every import in the file, however deeply nested."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def test_no_layer_imports_a_layer_above_it():
    upward = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package in LAYERS and LAYERS.index(package) > rank:
                    upward.append(f"{path.relative_to(ROOT)}:{line} imports {package}")
    assert not upward, "imports against the layers (gem <- experiments <- analysis <- paper_figures):\n" + "\n".join(
        upward
    )


def test_the_check_sees_a_function_local_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    if True:\n        from analysis import load\n")
    assert list(imported_packages(module)) == [(3, "analysis")]


def imported_test_modules(path: Path):
    """(line, module) of every import of a test module (test_*) or of conftest in the file, however deeply nested."""
    for line, package in imported_packages(path):
        if package == "conftest" or package.startswith("test_"):
            yield line, package


def test_no_file_under_tests_imports_a_test_module_or_conftest():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imported_test_modules(path)
    ]
    assert not found, "imports of test modules or conftest (move what they share into tests/helpers):\n" + "\n".join(
        found
    )


def test_the_tests_check_sees_every_kind_of_import(tmp_path):
    module = tmp_path / "test_m.py"
    module.write_text(
        "import conftest\nfrom helpers.paths import ROOT\nimport test_a.b\n\n\n"
        "def test_f():\n    from test_engines import run\n"
    )
    assert list(imported_test_modules(module)) == [(1, "conftest"), (3, "test_a"), (7, "test_engines")]


def test_no_module_of_gem_imports_another_s_private_names():
    """What one module of gem uses of another has a public name: a leading underscore says "only here" (the
    distributed engine imported a dozen of them across its files)."""
    private = []
    for path in sorted((ROOT / "gem").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gem"):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n} from {node.module}" for n in names]
    assert not private, "\n".join(private)
