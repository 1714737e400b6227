"""The tracking back ends by name: the one source of the names ``tracking.backends`` accepts, of the package each
needs with the install that provides it, and of the class that writes for it.

The built-in back ends are the rows of :data:`BUILTIN` (pyproject.toml also declares them in the entry-point
group ``llmrl.trackers``, like every plugin); another package adds one by naming a class that follows
:class:`~llmrl.engine.client.tracking.protocol.TrackerBackend` in that group::

    [project.entry-points."llmrl.trackers"]
    my_tool = "my_package.tracking:MyToolBackend"

Discovery reads entry-point metadata only: a back end's module is imported when a run opens it
(:func:`open_backend`), never when names are listed or a config is checked. A built-in name stays the built-in
back end whatever a package registers under it. This module writes nothing and chooses no paths or steps (the
tracker does); it imports nothing from the config (the config's checks import it).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from llmrl.engine.client.tracking.protocol import contract_problem
from llmrl.engine.entry_points import entry_points
from llmrl.engine.errors import InvalidArgument, PluginError, did_you_mean

GROUP = "llmrl.trackers"


class BackendMissing(ImportError):
    """A tracking back end's package is not installed."""


@dataclass(frozen=True)
class BackendInfo:
    """A tracking back end as the registry knows it before importing it.

    Attributes:
        name: what ``tracking.backends`` calls it.
        target: its class, ``module:Class``.
        package: the module it imports, checked for when a config is validated (None: none beyond its own).
        install: how to install ``package``.
        provider: who registers it: ``llmrl`` or the installed package, ``name version``.
    """

    name: str
    target: str
    package: str | None = None
    install: str = ""
    provider: str = "llmrl"


_MODULE = "llmrl.engine.client.tracking.backends"
_IN_CLONE = "in llmrl's clone"
BUILTIN = (
    BackendInfo("csv", f"{_MODULE}:CSVBackend"),
    BackendInfo("tensorboard", f"{_MODULE}:TensorBoardBackend", "tensorboard",
                f"pip install -e '.[tracking]' {_IN_CLONE}"),
    BackendInfo("trackio", f"{_MODULE}:TrackioBackend", "trackio",
                f"pip install -e '.[tracking-local]' {_IN_CLONE} (or pip install trackio)"),
    BackendInfo("wandb", f"{_MODULE}:WandbBackend", "wandb",
                f"pip install -e '.[tracking-local]' {_IN_CLONE} (or pip install wandb)"),
    BackendInfo("mlflow", f"{_MODULE}:MLflowBackend", "mlflow",
                f"pip install -e '.[tracking-all]' {_IN_CLONE} (or pip install mlflow-skinny)"),
)


def _registered() -> dict[str, list[BackendInfo]]:
    """Every entry point of :data:`GROUP`, by name (a name several packages register has several rows)."""
    found: dict[str, list[BackendInfo]] = {}
    for ep in entry_points(GROUP):
        dist = getattr(ep, "dist", None)
        provider = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an installed package"
        rows = found.setdefault(ep.name, [])
        if all(row.target != ep.value for row in rows):
            rows.append(BackendInfo(ep.name, ep.value, provider=provider))
    return found


def available() -> dict[str, BackendInfo]:
    """Every back end a config may name: the built-ins in :data:`BUILTIN`'s order, then the other names of the
    entry-point group, sorted (a name two packages register with different classes: the first found)."""
    out = {info.name: info for info in BUILTIN}
    for name, rows in sorted(_registered().items()):
        out.setdefault(name, rows[0])
    return out


def names() -> tuple[str, ...]:
    """The names of :func:`available`, in its order."""
    return tuple(available())


def unknown_message(name, known=None) -> str:
    """``"name" is not one of "csv", ...``, the closest name, and where others come from."""
    known = tuple(known if known is not None else names())
    options = ", ".join(json.dumps(n) for n in known)
    return (f"{json.dumps(name)} is not one of {options}{did_you_mean(str(name), known)}; a package adds a back end "
            f"through the entry-point group {GROUP}")


def name_problems(backends, at: str = "tracking.backends") -> list[tuple[str, str]]:
    """``(dotted path, message)`` for each name of ``backends`` that no back end has; values the schema refuses
    (not a list, not a string) are left to it."""
    if not isinstance(backends, (list, tuple)):
        return []
    known = names()
    return [(f"{at}.{i}", unknown_message(name, known)) for i, name in enumerate(backends)
            if isinstance(name, str) and name not in known]


def requirement(name: str) -> tuple[str, str] | None:
    """``(module, install)`` for a back end that needs a package, else None (csv, or a name no back end has)."""
    info = available().get(name)
    return (info.package, info.install) if info is not None and info.package else None


def require(name: str):
    """Import the package back end ``name`` needs (its module, or None when it needs none).

    Raises:
        BackendMissing: it is not installed, with the install that provides it.
    """
    needed = requirement(name)
    if needed is None:
        return None
    module, install = needed
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise BackendMissing(f"the {name} tracking back end needs the {module} package ({err}): {install}, or "
                             f"remove {name} from tracking.backends") from None


def backend_class(name: str) -> type:
    """The class of back end ``name``, imported.

    Raises:
        InvalidArgument: no back end has that name.
        PluginError: several packages register it with different classes, its module fails to import, or the
            class does not follow :class:`~llmrl.engine.client.tracking.protocol.TrackerBackend`.
    """
    known = available()
    if name not in known:
        raise InvalidArgument(f"tracking back end {unknown_message(name, known)}")
    info = known[name]
    rows = _registered().get(name, []) if info.provider != "llmrl" else []
    if len(rows) > 1:
        raise PluginError(f"tracking back end {name!r} is registered by several installed packages with different "
                          f"classes: {', '.join(f'{r.target} ({r.provider})' for r in rows)}; uninstall all but one")
    module_name, _, attr = info.target.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BackendMissing:
        raise
    except Exception as err:
        raise PluginError(f"tracking back end {name!r} ({info.target}, from {info.provider}) failed to import: "
                          f"{type(err).__name__}: {err}") from err
    problem = contract_problem(name, obj)
    if problem:
        raise PluginError(problem)
    return obj


def open_backend(name: str, run_dir: Path, root: Path, project: str, run_name: str, config: dict):
    """Open back end ``name`` for one run. ``run_dir``: this run's folder (made if missing); ``root``: the tracking
    ``dir`` (MLflow's and trackio's stores, shared by runs); ``config``: flat hyperparameters to record.

    Raises:
        BackendMissing: its package is not installed.
        PluginError: see :func:`backend_class`.
    """
    cls = backend_class(name)
    run_dir.mkdir(parents=True, exist_ok=True)
    return cls(run_dir=run_dir, root=root, project=project, run_name=run_name, config=config)
