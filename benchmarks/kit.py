"""What the benchmark borrows from outside the ``llmrl`` package, each loaded from its file: the test kit
(``tests/testkit``: ``LiveRun``, a real run whose client obeys this process, and ``tiny_model``) and the PPO demo's
modules (``examples/ppo_babyai.py``, which imports ``examples/babyai_text.py``).

Neither is installed with llmrl, so each is imported by its file path under the name its own code imports it by
(``testkit``, ``babyai_text``, ``ppo_babyai``); a module already imported under that name is reused. This module
does not change ``sys.path`` (``LiveRun`` puts ``tests/`` on its rank processes' ``PYTHONPATH``, and the demo script
puts its own folder on ``sys.path`` when it is imported: theirs to do). It measures nothing and starts nothing; the
folder it makes for the test kit's live runs is its own, removed at exit. It also says which results files a
benchmark may overwrite (:func:`claim_results_file`): only those a benchmark wrote.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
WRITER_KEY = "written by"  # the key that marks a results file as a benchmark's own


def testkit() -> ModuleType:
    """The test kit, imported as the package ``testkit`` (the name its modules and its rank processes use). Its live
    runs put their folders (config, ``run.log``) in one temporary folder of this process's, removed when the process
    ends, unless it ends on an uncaught exception (then the folder is kept and named, for the logs)."""
    kit = load_module("testkit", ROOT / "tests" / "testkit" / "__init__.py", package=True)
    live = sys.modules["testkit.live"]
    if live.WORK_ROOT is None:
        live.WORK_ROOT = tempfile.mkdtemp(prefix="llmrl-bench-")
        atexit.register(_remove_runs, live.WORK_ROOT)
    return kit


def _remove_runs(folder: str) -> None:
    if getattr(sys, "last_value", None) is not None:  # the process ends on an uncaught exception
        print(f"the live runs' folders (config, run.log) are kept in {folder}", file=sys.stderr)
        return
    shutil.rmtree(folder, ignore_errors=True)


def ppo_demo() -> ModuleType:
    """The PPO demo's module ``ppo_babyai`` (its ``Args``, ``prompt`` and ``candidates``, and ``TextVecEnv`` from
    ``babyai_text``, loaded first so that the demo's own import finds it)."""
    load_module("babyai_text", ROOT / "examples" / "babyai_text.py")
    return load_module("ppo_babyai", ROOT / "examples" / "ppo_babyai.py")


def load_module(name: str, path: Path, package: bool = False) -> ModuleType:
    """Import the file ``path`` as the module ``name`` (a package whose submodules lie beside it when ``package``),
    once: ``sys.modules[name]`` if it is already there."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path,
                                                  submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def profiling_timeouts(profile) -> dict:
    """Under ``--profile`` a server may be silent for tens of seconds while torch's profiler stops and tabulates a
    large request (it holds the interpreter: no heartbeat gets out), which the client would take for a dead rank."""
    return {"timeouts": {"dead_after": 900}} if profile else {}


def claim_results_file(path: str, writer: str) -> dict:
    """Check, before a benchmark measures anything, that its results may go to ``path`` (``--out``): a new file, or
    one an llmrl benchmark wrote (its JSON holds :data:`WRITER_KEY`). Raises SystemExit (a one-line reason) for
    anything else: a user's file is never overwritten. Returns the mark to start the results with."""
    target = Path(path)
    if target.is_dir():
        raise SystemExit(f"llmrl: --out {path} is a folder; name a results file")
    if target.exists():
        try:
            ours = str(json.loads(target.read_text()).get(WRITER_KEY, "")).startswith("llmrl benchmarks")
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise SystemExit(f"llmrl: {path} exists and was not written by an llmrl benchmark: it is not "
                             "overwritten; choose another --out, or move the file away")
    return {WRITER_KEY: f"llmrl benchmarks.{writer}"}
