"""The package's shape (docs/design.md, STYLE.md): no two modules import each other, directly or
through others (lazy imports inside functions included), and no class runs over 600 lines of code
(its lines less blank ones, comments and docstrings, as radon's SLOC counts)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "acco"
MAX_CLASS_LINES = 600


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE.parent).with_suffix("")).replace("/", "."): ast.parse(path.read_text())
            for path in PACKAGE.rglob("*.py")}  # fmt: skip


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            while name and name not in known:  # acco.elastic.TorchFT -> acco.elastic
                name = name.rpartition(".")[0]
            if name and name != "acco":
                found.add(name)
    return found


def test_the_import_graph_has_no_circle() -> None:
    trees = modules()
    graph = {name: imports(tree, set(trees)) - {name} for name, tree in trees.items()}
    circles = []

    def visit(name: str, path: list[str], done: set[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                done.add(target)
                visit(target, path + [target], done)

    for name in sorted(graph):
        visit(name, [name], set())
    assert not circles, circles


def test_no_class_runs_over_600_lines_of_code() -> None:
    long = []
    for name, tree in modules().items():
        lines = (PACKAGE.parent / (name.replace(".", "/") + ".py")).read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                docstrings = set()
                for inner in ast.walk(node):
                    body = getattr(inner, "body", None)
                    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                        docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
                code = [number for number in range(node.lineno, node.end_lineno + 1) if number not in docstrings
                        and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")]  # fmt: skip
                if len(code) > MAX_CLASS_LINES:
                    long.append((name, node.name, len(code)))
    assert not long, long
