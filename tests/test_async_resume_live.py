"""An asynchronous run (``AsyncRollouts`` sampling on a thread while the loop trains) killed mid-step and resumed
from its checkpoint loses and duplicates no sample, checked by the samples' call indices: the steps of the first run
up to the save and those of the resumed run train every call's batch once, in order. A batch that the checkpoint
held in its buffer is trained in the resumed run on the same tokens, at the same policy version, with the same loss
as the killed run trained it (the weights, the optimizer state and the buffer all came back)."""

from __future__ import annotations

import json

import pytest

from testkit import LiveRun

pytestmark = pytest.mark.slow
STEPS, SAVE_AFTER, STOP_AT = 8, 2, 4  # the save follows step 2's optim_step; the kill comes in step 4


def config(tiny, checkpoint=None) -> dict:
    llm = {"model": tiny["llama"], "initializers": [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}],
           "trainable": True, "training": {"optimizer": {"type": "adam", "lr": 0.05}}}
    if checkpoint:
        llm["checkpoint"] = checkpoint
    return {"llms": {"main": llm}, "threads_per_rank": 1}


def entries(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_for_entry(run: LiveRun, key: str) -> dict:
    """The loop's first entry holding ``key``, once written (it waits in the run's client, on the loop's event)."""
    entry = run.function("testkit.async_resume:wait_for", key)
    assert "error" not in entry, entry["error"]
    return entry


def test_an_async_run_killed_mid_step_and_resumed_trains_every_sample_once(tiny, tmp_path):
    checkpoint, first_log, second_log = tmp_path / "checkpoint", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    run = LiveRun(config(tiny))
    try:
        assert run.function("testkit.async_resume:start", str(first_log), STEPS, SAVE_AFTER, str(checkpoint),
                            STOP_AT) == {"step": 0, "next_call": 0}
        assert wait_for_entry(run, "stopped") == {"stopped": STOP_AT}
    finally:
        run.kill()  # SIGKILL to every process of the run, mid-step
    assert run.leftover_processes() == []

    with LiveRun(config(tiny, str(checkpoint))) as resumed:
        state = resumed.function("testkit.async_resume:start", str(second_log), STEPS, SAVE_AFTER,
                                 str(tmp_path / "unused"))
        assert wait_for_entry(resumed, "done") == {"done": STEPS}
        assert resumed.close() == 0
    assert state["step"] == SAVE_AFTER + 1

    first = [e for e in entries(first_log) if "step" in e]
    second = [e for e in entries(second_log) if "step" in e]
    assert [e["step"] for e in first] == list(range(STOP_AT + 1))
    assert [e["step"] for e in second] == list(range(SAVE_AFTER + 1, STEPS))
    kept = [e for e in first if e["step"] <= SAVE_AFTER]  # what the checkpoint holds the training of
    assert [e["index"] for e in kept + second] == list(range(STEPS)), "every call's batch once, in order"
    # the batch the checkpoint buffered was sampled before the kill: the resumed run trains it first, on the same
    # tokens and from the same weights as the killed run did (the loss before the step equals)
    assert state["next_call"] == SAVE_AFTER + 2  # the loop saved once the next batch was in the buffer
    buffered, killed = second[0], first[SAVE_AFTER + 1]
    assert buffered["index"] == killed["index"] == SAVE_AFTER + 1
    assert (buffered["tokens"], buffered["version"]) == (killed["tokens"], killed["version"])
    assert buffered["loss"] == pytest.approx(killed["loss"], rel=1e-6)
