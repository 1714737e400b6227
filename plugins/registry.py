"""Find plugins by name: entry points, ``module:attr``, or ``__main__:Name`` from the user's RL script.

Entry-point groups are ``llmrl.heads``, ``llmrl.initializers`` and ``llmrl.updaters``; the built-in
plugins are registered in them exactly like third-party ones. Only the plugins a config names are
imported. An unknown name lists the available ones and suggests the closest; an import that fails is
re-raised naming the plugin, with the original error chained; a class that breaks its contract or
arguments that break its ``args_schema`` are reported before any model loads.

``__main__:Name`` refers to a class defined in the RL script. Server ranks never run the script; they
import it as a module named ``__llmrl_script__`` (like multiprocessing's spawn does), so its top-level
code runs but its ``if __name__ == "__main__":`` block does not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
from pathlib import Path

from llmrl.engine.config.types import PluginSpec
from llmrl.engine.entry_points import entry_points as installed_entry_points
from llmrl.engine.errors import PluginError, did_you_mean

GROUPS = {"head": "llmrl.heads", "initializer": "llmrl.initializers", "updater": "llmrl.updaters"}
SCRIPT_MODULE_NAME = "__llmrl_script__"

_script_source: tuple[str, str] | None = None  # ("path", file) or ("module", name)
_script_module = None
importing_script = False  # True while a server imports the RL script (a Caller there is a mistake)


def entry_points(kind: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The installed plugins of contract ``kind`` by name (read once per process: :mod:`llmrl.engine.entry_points`)."""
    return {ep.name: ep for ep in installed_entry_points(GROUPS[kind])}


def installed_plugins() -> list[dict[str, str]]:
    """Every plugin registered through entry points, without importing any: name, group, package, target."""
    rows = []
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group in GROUPS.values():
                rows.append({"name": ep.name, "group": ep.group, "package": f"{dist.metadata['Name']} {dist.version}",
                             "target": ep.value})
    unique = {(r["group"], r["name"], r["package"]): r for r in rows}
    return sorted(unique.values(), key=lambda r: (r["group"], r["name"]))


def set_script(path: str | None = None, module: str | None = None) -> None:
    """Tell this process where the RL script is (servers: from the launch command line)."""
    global _script_source, _script_module
    _script_source = ("path", path) if path else ("module", module) if module else None
    _script_module = None


def script_module():
    """The RL script imported as a module (once), for ``__main__:Name`` plugins and unpickling."""
    global _script_module, importing_script
    if _script_module is not None:
        return _script_module
    main = sys.modules.get("__main__")
    if _script_source is None:
        if main is not None and getattr(main, "__file__", None):
            return main  # the client: the script *is* __main__
        raise PluginError("a __main__:Name plugin needs the RL script, but this process does not know it")
    kind, where = _script_source
    importing_script = True
    try:
        if kind == "path":
            spec = importlib.util.spec_from_file_location(SCRIPT_MODULE_NAME, where)
            if spec is None or spec.loader is None:
                raise PluginError(f"cannot import the RL script {where!r}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[SCRIPT_MODULE_NAME] = module
            sys.path.insert(0, str(Path(where).resolve().parent))
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except PluginError:
        raise
    except BaseException as err:
        sys.modules.pop(SCRIPT_MODULE_NAME, None)
        raise PluginError(f"importing the RL script {where!r} on a server (to find its plugins) failed: "
                          f"{type(err).__name__}: {err}. Plugins defined in the script must be at top level, and "
                          "the RL loop must be under `if __name__ == '__main__':`") from err
    finally:
        importing_script = False
    _script_module = module
    return module


def resolve(kind: str, name: str):
    """The plugin class named ``name`` for contract ``kind`` (head, initializer, updater)."""
    from llmrl.plugins.checks import contract_problem

    if ":" in name:
        module_name, _, attr = name.partition(":")
        if module_name == "__main__":
            module = script_module()
        else:
            try:
                module = importlib.import_module(module_name)
            except Exception as err:
                raise PluginError(f"{kind} plugin {name!r}: importing {module_name!r} failed: "
                                  f"{type(err).__name__}: {err}") from err
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                public = [n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_")]
                raise PluginError(f"{kind} plugin {name!r}: {module_name!r} has no attribute {attr!r}"
                                  f"{did_you_mean(attr, public, cutoff=0.5)}")
            obj = getattr(obj, part)
        cls = obj
    else:
        eps = entry_points(kind)
        if name not in eps:
            available = sorted(eps)
            raise PluginError(f"unknown {kind} plugin {name!r}{did_you_mean(name, available, cutoff=0.5)}; "
                              f"installed {kind}s: "
                              f"{', '.join(available) or 'none'} (entry-point group {GROUPS[kind]}); "
                              "local classes can be named module:Class or __main__:Class")
        targets = sorted({ep.value for ep in installed_entry_points(GROUPS[kind], name)})
        if len(targets) > 1:  # which one importlib returns last depends on sys.path's order: never guess
            raise PluginError(f"{kind} plugin {name!r} is registered by several installed packages, with different "
                              f"targets: {', '.join(targets)}; name the one you mean as module:attr (e.g. "
                              f"{targets[0]}), or uninstall the other (`llmrl plugins` lists them)")
        try:
            cls = eps[name].load()
        except Exception as err:
            raise PluginError(f"{kind} plugin {name!r} ({eps[name].value}) failed to import: "
                              f"{type(err).__name__}: {err}") from err
    problem = contract_problem(kind, cls, name)
    if problem:
        raise PluginError(problem)
    return cls


def build(kind: str, spec, *, llm=None):
    """Resolve and instantiate a plugin spec (``PluginSpec``); errors name the plugin."""
    from llmrl.plugins.checks import args_problem

    cls = resolve(kind, spec.plugin)
    problem = args_problem(cls, spec.args, spec.plugin)
    if problem:
        raise PluginError(f"{kind} plugin {spec.plugin!r}: bad arguments: {problem}")
    try:
        return cls(llm, **spec.args) if kind == "head" else cls(**spec.args)
    except Exception as err:
        raise PluginError(f"{kind} plugin {spec.plugin!r}: constructing it failed: "
                          f"{type(err).__name__}: {err}") from err


def plugin_problems(data: dict) -> list[tuple[str, str]]:
    """Config-time checks of every named plugin (``__main__`` ones are checked when servers start). A config that
    names none imports neither the checks nor torch (``llmrl run`` then starts its launcher without them)."""
    problems = []
    for llm_name, llm in data["llms"].items():
        at = f"llms.{llm_name}"
        refs = [(f"{at}.initializers.{i}", "initializer", p) for i, p in enumerate(llm.get("initializers") or [])]
        refs += [(f"{at}.heads.{key}", "head", p) for key, p in (llm.get("heads") or {}).items()]
        if llm.get("updater"):
            refs.append((f"{at}.updater", "updater", llm["updater"]))
        for path, kind, ref in refs:
            from llmrl.plugins.checks import args_problem

            spec = PluginSpec.coerce(ref)
            name, args = spec.plugin, spec.args
            if name.startswith("__main__:"):
                continue
            try:
                cls = resolve(kind, name)
            except PluginError as err:
                problems.append((path, str(err)))
                continue
            problem = args_problem(cls, args, name)
            if problem:
                problems.append((f"{path}.args", problem))
    return problems
