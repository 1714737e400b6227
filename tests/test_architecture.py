"""The tree's rules, read from the source (nothing is imported): no module over 400 lines, no import cycle between
modules (imports inside functions count), the engine never imports ``launch``, plugins never import the request
path (they may import the engine's leaf modules), the engine never imports a built-in plugin (only the plugin API:
the contracts, their checks, the registry), the model layer never imports the request kinds, and every module opens
with a docstring; and the folder above the repository stays off the import path."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("engine", "plugins", "launch", "benchmarks", "examples", "docs")
PLUGIN_MAY_IMPORT = ("llmrl.engine.errors", "llmrl.engine.graph", "llmrl.engine.config.types",
                     "llmrl.engine.config.checks", "llmrl.engine.token_losses", "llmrl.engine.episode_returns")
# The seam between the engine and the plugins: the plugin API, the only modules of ``llmrl.plugins`` the engine may
# import. The contracts and the types they are made of (a Trainer, an UpdateBatch, per-sample arguments, the
# steering hook's view), their checks and the registry that finds plugins by entry point. Every other module of
# ``llmrl.plugins`` is a built-in plugin or its maths (``rl_math``), reached by the engine through the registry
# only; maths the engine needs itself lives in the engine (``llmrl.engine.token_losses``,
# ``llmrl.engine.episode_returns``) and ``rl_math`` re-exports it. A seam module imports no built-in plugin either.
PLUGIN_API = ("llmrl.plugins", "llmrl.plugins.contracts", "llmrl.plugins.trainer_api", "llmrl.plugins.update_batch",
              "llmrl.plugins.per_sample", "llmrl.plugins.steering_api", "llmrl.plugins.checks",
              "llmrl.plugins.registry")


def modules() -> dict[str, Path]:
    """Every module of the code folders by its dotted name (the repository root is the package ``llmrl``;
    ``benchmarks`` is run from the root under its own name)."""
    found = {}
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "build" in path.relative_to(ROOT).parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            prefix = [] if folder == "benchmarks" else ["llmrl"]
            found[".".join(prefix + parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its file (a name imported from a package counts
    as its submodule when there is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for imported in names:
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_cycle_finder_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the walk found the tree
    assert cycles(graph) == []


def test_imports_go_one_way():
    wrong = []
    for name, targets in import_graph().items():
        for target in targets:
            if name.startswith("llmrl.engine") and target.startswith("llmrl.launch"):
                wrong.append(f"{name} -> {target} (the engine never imports launch)")
            if (name.startswith("llmrl.plugins") and target.startswith("llmrl.engine")
                    and target not in PLUGIN_MAY_IMPORT):
                wrong.append(f"{name} -> {target} (plugins import only {', '.join(PLUGIN_MAY_IMPORT)})")
            if name.startswith("llmrl.engine.model") and target.startswith("llmrl.engine.requests"):
                wrong.append(f"{name} -> {target} (the model layer never imports the request kinds: a request "
                             "kind unpacks its request into plain arguments)")
    assert wrong == [], "\n".join(wrong)


def test_the_engine_imports_no_built_in_plugin():
    """The engine (and the plugin API it imports) reaches the plugins through the seam only: :data:`PLUGIN_API`."""
    graph, wrong = import_graph(), []
    assert set(PLUGIN_API) <= set(graph)  # the seam names modules that exist
    for name, targets in graph.items():
        if name.startswith("llmrl.engine") or name in PLUGIN_API:
            wrong += [f"{name} -> {target} (the engine and the plugin API import only the plugin API of "
                      f"llmrl.plugins: {', '.join(PLUGIN_API)}; reach a built-in plugin through the registry)"
                      for target in sorted(targets)
                      if target.startswith("llmrl.plugins") and target not in PLUGIN_API]
    assert wrong == [], "\n".join(wrong)


def test_no_module_over_400_lines_and_every_module_has_a_docstring():
    too_long, undocumented = [], []
    for path in modules().values():
        source = path.read_text()
        if source.count("\n") > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        if not ast.get_docstring(ast.parse(source)):
            undocumented.append(str(path.relative_to(ROOT)))
    tests = sorted((ROOT / "tests").rglob("*.py"))
    too_long += [f"{p.relative_to(ROOT)}: {p.read_text().count(chr(10))} lines" for p in tests
                 if p.read_text().count("\n") > 400]
    assert too_long == [] and undocumented == []


def test_the_folder_above_the_repository_is_not_on_the_import_path():
    """The repository root is the package ``llmrl``: pytest's default import mode would put the folder above it first
    on ``sys.path``, where a folder named like a module (a ``z3`` beside the clone) would shadow the real module
    (pyproject.toml imports by importlib instead)."""
    import os
    import sys

    above = Path(ROOT.parent)
    entries = [entry for entry in sys.path if entry not in ("", os.getcwd())]  # (Python's own: where pytest runs)
    assert all(Path(entry).resolve() != above for entry in entries), sys.path
