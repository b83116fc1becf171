"""Each room of the code imports only what docs/architecture.md says it may (every import, at any depth); the
runtime in services/ never imports its training code (services/training/); services/ has no import cycle."""

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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, package: str = "services") -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports (every import statement, at any depth):
    ``from services import x`` is services.x; ``from services.a import b`` is services.a, or services.a.b where that
    is a module."""
    modules = {module_name(f, root): f for f in (root / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts (a -> b -> a), or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for imported in sorted(graph[module]):
            if imported in path:
                return path[path.index(imported):] + [imported]
            if imported not in done and (cycle := visit(imported)):
                return cycle
        done.add(path.pop())
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)):
            return cycle
    return None


def training_imports(root: Path = ROOT) -> list[str]:
    """Where a module of services/ outside services/training/ imports services.training."""
    runtime = [f for f in (root / "services").rglob("*.py") if (root / "services" / "training") not in f.parents]
    return [f"{f.relative_to(root)}:{line} imports {module}" for f in runtime for line, module in imports(f)
            if outside(module, ("services.training",))]


def test_runtime_never_imports_training():
    """Serving and benchmarking load what the recipes wrote; the recipes themselves stay out of the runtime."""
    assert (ROOT / "services" / "training" / "__init__.py").is_file()
    wrong = training_imports()
    assert not wrong, "\n".join(wrong)


def test_services_has_no_import_cycle():
    graph = import_graph()
    assert "services.runner" in graph and "services.training.distill" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_training_and_cycle_checks_can_fail(tmp_path):
    (tmp_path / "services" / "training").mkdir(parents=True)
    (tmp_path / "services" / "training" / "recipe.py").write_text("from services import a\n")
    (tmp_path / "services" / "a.py").write_text("from services.b import thing\n")
    (tmp_path / "services" / "b.py").write_text("def thing():\n    from services import training\n    import services.a\n")
    assert training_imports(tmp_path) == ["services/b.py:2 imports services.training"]
    graph = import_graph(tmp_path)
    assert graph["services.training.recipe"] == {"services.a"}
    assert find_cycle(graph) == ["services.a", "services.b", "services.a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
