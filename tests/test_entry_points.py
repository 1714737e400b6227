"""Entry points read once per process (:mod:`llmrl.engine.entry_points`) equal ``importlib.metadata``'s own answer,
and a distribution on a folder added to ``sys.path`` later is seen at the next call."""

from __future__ import annotations

import importlib.metadata

from llmrl.engine.entry_points import entry_points
from testkit.distributions import write_distribution


def plain(group: str, name: str | None = None) -> list:
    found = importlib.metadata.entry_points(group=group)
    return list(found if name is None else found.select(name=name))


def test_a_group_equals_importlibs_and_a_folder_added_to_sys_path_is_read(tmp_path, monkeypatch):
    for group in ("llmrl.heads", "llmrl.updaters", "llmrl.initializers", "console_scripts"):
        assert entry_points(group) == plain(group)
    assert entry_points("llmrl.updaters", "grpo") == plain("llmrl.updaters", "grpo") != []
    write_distribution(tmp_path, "late-llmrl-plugins", """
        [llmrl.updaters]
        late_updater = late_module:LateUpdater
    """)
    assert entry_points("llmrl.updaters", "late_updater") == []
    monkeypatch.syspath_prepend(str(tmp_path))
    (late,) = entry_points("llmrl.updaters", "late_updater")
    assert late.value == "late_module:LateUpdater" and entry_points("llmrl.updaters") == plain("llmrl.updaters")
