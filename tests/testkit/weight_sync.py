"""A sync sent while a sampler's ``generate`` is in flight, run in a live run's client (through
:meth:`testkit.live.LiveRun.function`): the Caller's futures stay in the client process. Test code, never shipped."""

from __future__ import annotations


def sync_between_two_generates(caller, prompt: list[int], source: str, target: str) -> dict:
    """``generate`` on ``target``, then ``sync_weights`` from ``source``, then ``generate`` again, all sent before
    any answer is read: the versions and tokens each ``generate`` drew from, and the sync's answer."""
    before = caller.generate_async([prompt], llm=target, max_new_tokens=8, seed=1)
    synced = caller.sync_weights(source, target)
    after = caller.generate_async([prompt], llm=target, max_new_tokens=8, seed=1)
    first, second = before.result()[0][0], after.result()[0][0]
    return {"synced": synced, "before": (first["policy_version"], list(first["tokens"])),
            "after": (second["policy_version"], list(second["tokens"]))}
