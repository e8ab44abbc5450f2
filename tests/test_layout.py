"""The package's import layering: kernels < modeling < convert < eval, and no module imports its importer back.

Read from the sources (every `from ... import`, inside functions too), not from what one run happens
to import, so a lazy import that closes a circle fails here as well.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEVELS = {"kernels": 0, "modeling": 1, "convert": 2, "eval": 3}


def package_imports() -> dict[str, set[str]]:
    """module ("convert.train") -> the package modules it imports."""
    modules = {f"{folder}.{path.stem}": path for folder in LEVELS for path in (ROOT / folder).glob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        folder = name.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if not (node.module or "").startswith("linearize."):
                    continue
                base = node.module.removeprefix("linearize.")
            else:
                base = ".".join(filter(None, [folder if node.level == 1 else "", node.module or ""]))
            targets = [base] if base in modules else [f"{base}.{alias.name}" for alias in node.names]
            edges.setdefault(name, set()).update(t for t in targets if t in modules and t != name)
    return edges


def test_nothing_imports_upward():
    upward = [
        f"{module} imports {target}"
        for module, targets in package_imports().items()
        for target in targets
        if LEVELS[target.split(".")[0]] > LEVELS[module.split(".")[0]]
    ]
    assert upward == []


def test_no_import_circles():
    edges = package_imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    circles = sorted(m for m in edges if reaches(m, m, set()))
    assert circles == []


@pytest.mark.parametrize("edge", [("kernels.ops", "convert.train"), ("convert.plan", "convert.recipes")])
def test_the_checks_can_fail(edge, monkeypatch):
    """An upward edge and a circle (recipes already imports plan) are each caught."""
    real = package_imports()
    module, target = edge
    monkeypatch.setitem(globals(), "package_imports", lambda: {**real, module: real.get(module, set()) | {target}})
    failing = test_nothing_imports_upward if LEVELS[target.split(".")[0]] > LEVELS[module.split(".")[0]] else test_no_import_circles
    with pytest.raises(AssertionError):
        failing()
