"""A damaged or crafted adapter state is refused before anything changes, naming the field: moments of another
shape or dtype, step counts below 1, negative second moments, non-finite weights or moments, another optimizer's
state. A state as torch's own AdamW keeps it passes, and loads into an optimizer whose next step equals that of the
optimizer it was saved from."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from llmrl.engine.model.training.adapter_state_checks import check_against, check_values, loaded

HOW = {"rank": 2, "alpha": 4.0, "seed": 0, "targets": ["q_proj"], "dropout": 0.0}


def trained_state():
    """A weight stepped twice by plain AdamW, its state saved as save_adapter saves it; and that optimizer."""
    w = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(2):
        w.grad = torch.ones_like(w)
        optimizer.step()
    saved = {k: v.detach().clone() for k, v in optimizer.state[w].items()}
    return {"weights": {"w": w.detach().clone()}, "optimizer": {"w": saved}, "how": dict(HOW)}, w, optimizer


def refused(state, params, optimizer, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_values(state, "saved", optimizer=True)
        check_against(state, params, optimizer, "saved")


def test_a_state_saved_from_plain_adamw_passes_and_steps_on_as_the_original():
    state, w, original = trained_state()
    here = torch.nn.Parameter(state["weights"]["w"].clone())
    optimizer = torch.optim.AdamW([here], lr=1e-2)
    check_values(state, "saved", optimizer=True)
    check_against(state, {"w": here}, optimizer, "saved")
    optimizer.state[here] = {k: loaded(v, k, here.device) for k, v in state["optimizer"]["w"].items()}
    for p, opt in ((w, original), (here, optimizer)):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    assert torch.equal(here, w)  # the third step, as the original optimizer took it


def test_each_damaged_or_crafted_field_is_refused_naming_it():
    state, w, optimizer = trained_state()
    params = {"w": torch.nn.Parameter(w.detach().clone())}
    here = torch.optim.AdamW(params.values(), lr=1e-2)
    cases = [
        (("optimizer", "w", "exp_avg"), torch.zeros(1), r"optimizer\['w'\]\['exp_avg'\] has shape \[1\], and the "
                                                        r"weight it belongs to \[4, 6\]"),
        (("optimizer", "w", "step"), torch.tensor(-1.0), r"optimizer\['w'\]\['step'\] must be a whole number >= 1.* "
                                                         r"got -1; .*optimizer=False"),
        (("optimizer", "w", "step"), torch.tensor(0.0), r"\['step'\] must be a whole number >= 1"),
        (("optimizer", "w", "step"), 2.5, r"\['step'\] must be a whole number >= 1.* got 2.5"),
        (("optimizer", "w", "exp_avg_sq"), torch.ones(4, 6, dtype=torch.bfloat16),
         r"optimizer\['w'\]\['exp_avg_sq'\] is torch.bfloat16, and the weight it belongs to torch.float32"),
        (("optimizer", "w", "exp_avg"), torch.full((4, 6), float("nan")),
         r"optimizer\['w'\]\['exp_avg'\] holds a value that is not finite \(nan\)"),
        (("optimizer", "w", "exp_avg_sq"), -torch.ones(4, 6), r"\['exp_avg_sq'\] holds a negative value"),
        (("optimizer", "w", "momentum_buffer"), torch.zeros(4, 6),
         r"optimizer\['w'\] holds \['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step'\], and this LLM's "
         r"optimizer \(AdamW\) keeps \['exp_avg', 'exp_avg_sq', 'step'\]"),
        (("weights", "w"), torch.full((4, 6), float("inf")), r"weights\['w'\] holds a value that is not finite "
                                                             r"\(inf\); the file is damaged"),
        (("weights", "w"), torch.ones(4, 6, dtype=torch.int64), r"weights\['w'\] must be a floating-point tensor"),
        (("how", "rank"), -3, r"how\['rank'\] must be a positive int, got -3"),
        (("optimizer", "ghost"), {}, r"optimizer\['ghost'\] belongs to no saved weight"),
    ]
    for (part, *keys), value, match in cases:
        bad = copy.deepcopy(state)
        target = bad[part]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        refused(bad, params, here, match)
    sgd = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"keeps \['momentum_buffer'\]: it was saved by another kind of optimizer"):
        check_against(state, params, sgd, "saved")
    moments_only = copy.deepcopy(state)
    moments_only["optimizer"]["w"]["step"] = torch.tensor(-1.0)
    check_values(moments_only, "saved", optimizer=False)  # not loaded: not in the way of the weights
    defaults = copy.deepcopy(state)
    defaults["how"].update(alpha=None, targets=None)  # create_adapter's defaults (2 x rank, all-linear)
    check_values(defaults, "saved", optimizer=True)


def test_a_staging_folder_a_killed_save_left_is_removed_with_a_note_and_nothing_else(tmp_path):
    """Only ``.<name>.partial-<pid>`` folders holding what save_adapter writes, of a process that has ended."""
    import logging
    import subprocess
    import sys

    from llmrl.engine.log import logger
    from llmrl.engine.model.training.adapter_state import remove_stale_staging

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()

    def staged(name: str, extra: str | None = None):
        folder = tmp_path / name
        (folder / "peft").mkdir(parents=True)
        (folder / "adapter_state.pt").write_bytes(b"state")
        (folder / "peft" / "adapter_config.json").write_text("{}")
        if extra:
            (folder / extra).write_text("not ours")
        return folder

    stale = staged(f".s.partial-{ended.pid}")
    kept = [staged(f".live.partial-{os.getpid()}"),  # a save under way (this process)
            staged(f".mine.partial-{ended.pid}", extra="notes.txt"),  # holds what save_adapter does not write
            staged(f"s.partial-{ended.pid}"),  # not the staging name
            staged(f".s.partial-{ended.pid}x")]
    (tmp_path / f".f.partial-{ended.pid}").write_text("a file")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        assert remove_stale_staging(tmp_path) == [stale]
    finally:
        logger.removeHandler(handler)
    assert not stale.exists() and all(folder.is_dir() for folder in kept)
    assert (tmp_path / f".f.partial-{ended.pid}").is_file()
    assert [r.getMessage() for r in records] == [
        f"removed {stale}: what a save_adapter of {tmp_path / 's'} killed half-way (process {ended.pid}, no longer "
        "running) left behind"]


def test_a_file_that_is_not_a_state_is_refused_naming_it(tmp_path):
    from llmrl.engine.model.training.adapter_state import read_state

    (tmp_path / "adapter_state.pt").write_bytes(b"cut short")
    with pytest.raises(ValueError, match=r"adapter_state.pt cannot be read \(.*\); the file is damaged"):
        read_state(str(tmp_path))
    torch.save([1, 2], tmp_path / "adapter_state.pt")
    with pytest.raises(ValueError, match=r"adapter_state.pt holds a list, not an adapter state"):
        read_state(str(tmp_path))
