"""The package's layering, checked on every CI run (T28): no import cycle among offload's modules,
lower layers never importing upper ones, no module over 600 lines.

Every import counts, as an import-graph tool sees them: at the top, inside functions (a lazy
import is still a dependency) and under ``TYPE_CHECKING`` (use a protocol, or move the type down).
The graph is read from the source with ``ast``, so nothing is imported to check it.

There are none: the schedules see the engine through a protocol (``engine/schedules/engine_view.py``),
the probe's wrappers see the probe through one (``planner/instrument.py``), and the planner's
per-layer figures sit under its types and its table (``planner/layer_costs.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload"
MAX_LINES = 600

# The layers, bottom up (docs/design.md draws them): host -> engine -> tiling, quantized, fp8,
# forwards -> planner -> layers -> the front (api, activations, plan_steps, graphs, scope) ->
# integrations. (importer prefix, what it may not import, why, the one documented exception).
FRONT = ("offload.api", "offload.activations", "offload.plan_steps", "offload.graphs", "offload.scope",
         "offload.integrations", "offload.parallel")
CONTRACTS = [
    ("offload.host", ("offload.engine", "offload.layers", "offload.forwards", "offload.planner", "offload.tiling",
                      "offload.quantized", "offload.fp8", "offload.plot") + FRONT,
     "host memory sits under everything", ()),
    ("offload.engine", ("offload.layers", "offload.forwards", "offload.planner", "offload.tiling") + FRONT,
     "the engine sits under the forwards, the planner and the entry points",
     # The planned schedule reads a plan's data (its types and cost model), nothing of the search.
     (("offload.engine.schedules.planned", "offload.planner.types"),
      ("offload.engine.schedules.planned", "offload.planner.model"))),
    ("offload.engine.schedules", ("offload.engine.core", "offload.engine.copies", "offload.engine.lifecycle",
                                  "offload.engine.packing"),
     "the engine drives the schedules, which see it through schedules/engine_view.py", ()),
    ("offload.engine.step", ("offload.engine.core", "offload.engine.lifecycle"), "the engine holds the step state", ()),
    ("offload.tiling", ("offload.planner", "offload.engine", "offload.layers", "offload.forwards.plan_wrappers") + FRONT,
     "tiling is torch-only math under everything", ()),
    ("offload.quantized", ("offload.engine", "offload.planner", "offload.layers", "offload.forwards", "offload.fp8")
     + FRONT, "quantized storages sit under the engine's users", ()),
    ("offload.fp8", ("offload.planner", "offload.layers", "offload.forwards") + FRONT,
     "FP8 layers are model code under the entry points", ()),
    ("offload.forwards", ("offload.layers", "offload.planner") + FRONT,
     "forward stand-ins sit under the planner that chooses them", ()),
    ("offload.planner", ("offload.activations", "offload.plan_steps", "offload.forwards.plan_wrappers",
                         "offload.layers.model_form", "offload.integrations"),
     "the planner sits under the contexts that follow its plans", ()),
    ("offload.planner.actions", ("offload.planner.",), "the planner's lowest module", ()),
    ("offload.planner.layer_costs", ("offload.planner.types", "offload.planner.model", "offload.planner.table"),
     "per-layer figures sit under types, model and table", ()),
    ("offload.layers", ("offload.activations", "offload.plan_steps", "offload.integrations"),
     "finding layers sits under the entry points", ()),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif target in modules:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    # Tarjan's strongly connected components; a component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges_inside(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    return sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(", ".join(_edges_inside(graph, c)) for c in cycles)


def test_lower_layers_do_not_import_upper_ones() -> None:
    graph = _graph()
    broken = []
    for importer, forbidden, why, allowed in CONTRACTS:
        for name, targets in graph.items():
            if name != importer and not name.startswith(importer + "."):
                continue
            for target in targets:
                if (name, target) in allowed:
                    continue
                if any(target == f or target.startswith(f if f.endswith(".") else f + ".") for f in forbidden):
                    broken.append(f"{name} imports {target} ({why})")
    assert not broken, "; ".join(sorted(broken))


def test_nothing_but_the_front_imports_the_integrations() -> None:
    graph = _graph()
    users = sorted(name for name, targets in graph.items() if not name.startswith("offload.integrations")
                   and any(t.startswith("offload.integrations") for t in targets))
    assert not users, f"{users} import offload.integrations, which sits above the core and imports it"


def test_no_module_over_600_lines() -> None:
    long = {str(path.relative_to(ROOT)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_checker_sees_a_cycle(tmp_path: Path) -> None:
    # The graph reader on a made-up pair that imports each other, one of them lazily.
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert _cycles(graph) == [frozenset({"p.a", "p.b"})]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .other import thing\n")
    assert _imports("offload.x.m", source, {"offload.x.other": source}) == {"offload.x.other"}


def test_every_subpackage_says_its_one_job() -> None:
    # Each folder's __init__ opens with a docstring naming its job (what a newcomer reads first).
    missing = sorted(str(path.relative_to(ROOT)) for path in PACKAGE.rglob("__init__.py")
                     if not ast.get_docstring(ast.parse(path.read_text())))
    assert not missing, f"subpackages without a docstring: {missing}"
