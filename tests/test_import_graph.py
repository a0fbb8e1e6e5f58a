"""The packages' modules import one another without circles (issue 41): counting imports inside functions too, the
graph of `osd.*` and `osd_bench.*` imports has no cycle, so each part can be read and changed from the bottom up; and
the product (`osd`) never imports the evidence harness (`osd_bench`, issue 61): the harness imports the product."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in [*(SRC / "osd").rglob("*.py"), *(SRC / "osd_bench").rglob("*.py")]:
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every `osd.*` module that imports an `osd_bench.*` one, as 'importer -> imported'."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.split(".")[0] == "osd"
                  for b in targets if b.split(".")[0] == "osd_bench")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 100 and graph["osd.engine"]  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_product_never_imports_the_harness():
    graph = import_graph()
    assert any(a.startswith("osd_bench.") and any(b.startswith("osd.") for b in bs) for a, bs in graph.items())
    assert upward_imports(graph) == []


def test_the_upward_import_finder_finds_one():
    graph = {"osd.serve.app": {"osd_bench.report", "osd.engine"}, "osd_bench.report": {"osd.records"},
             "osd.engine": set(), "osd.records": set()}
    assert upward_imports(graph) == ["osd.serve.app -> osd_bench.report"]


def test_the_harness_commands_reach_the_cli_through_the_entry_point():
    """`osd bench`, `osd demo` and `osd replay` come from osd_bench by its `osd.commands` entry point, not an import."""
    from osd.cli import COMMANDS_GROUP, build_parser

    import tomllib

    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][COMMANDS_GROUP] == {"bench": "osd_bench.cli:register"}
    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"serve", "generate", "demo", "replay", "bench"} <= set(commands)
