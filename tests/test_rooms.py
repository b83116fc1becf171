"""Each room of the code imports only what docs/architecture.md says it may (every import, at any depth)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# room -> module prefixes it must not import
FORBIDDEN = {
    "services": ("ray", "grpc", "fastapi", "starlette", "deployments", "splitspec"),
    "deployments": ("splitspec.bench", "splitspec.checks", "splitspec.cli", "splitspec.cluster"),
    "splitspec/api": ("deployments", "services", "ray", "torch", "transformers", "splitspec.bench", "splitspec.checks",
                      "splitspec.cli"),
}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def outside(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    files = [f for f in (ROOT / room).rglob("*.py") if "_pb2" not in f.name]
    assert files, f"no modules in {room}/"
    wrong = [f"{f.relative_to(ROOT)}:{line} imports {module}" for f in files for line, module in imports(f)
             if outside(module, FORBIDDEN[room])]
    assert not wrong, "\n".join(wrong)


def test_the_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ray import serve\n")
    assert outside(imports(bad)[0][1], FORBIDDEN["services"])
