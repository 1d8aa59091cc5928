"""The layers import one way: gem <- experiments <- analysis <- paper_figures. An import of a higher layer from a
lower one, at module level or inside a function, is a circle Python would not notice (the function-local import
runs late), and it makes the lower layer unusable without the higher one."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
        upward)


def test_the_check_sees_a_function_local_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    if True:\n        from analysis import load\n")
    assert list(imported_packages(module)) == [(3, "analysis")]
