"""Syncs sent while a sampler's ``generate`` is in flight, run in a live run's client (through
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


def sync_in_flight(caller, prompts: list[list[int]], source: str, target: str, gate: str) -> dict:
    """With ``target`` held busy by its ``gate`` head (the file ``gate`` locked here: see ``GateHead``): a greedy
    ``generate`` of ``prompts`` (one per decode batch), then ``sync_weights_async(in_flight=True)`` from ``source``,
    both queued; then the gate opens. The tokens and version of each prompt's sample, and the sync's answer."""
    import fcntl

    with open(gate, "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # (let go when the file closes, whatever happened)
        busy = caller.custom_module_fns_async(["gate"], ["held"], llm=target)
        call = caller.generate_async(prompts, llm=target, max_new_tokens=6, do_sample=False, minibatch_size=1)
        synced = caller.sync_weights_async(source, target, in_flight=True)  # returns once the write was sent
    busy.result()
    samples = [per_prompt[0] for per_prompt in call.result()]
    return {"synced": synced.result(), "samples": [(s["policy_version"], list(s["tokens"])) for s in samples]}


_SENT: dict = {}  # (source, target) -> the future of a sync_weights_async sent by send_sync


def send_sync(caller, source: str, target: str, via: str) -> None:
    """``sync_weights_async`` from ``source`` into ``target`` by route ``via``, returning as it returns (the
    source's weights read and sent); its future stays in the client for :func:`sync_answer`."""
    _SENT[(source, target)] = caller.sync_weights_async(source, target, via=via)


def sync_answer(caller, source: str, target: str) -> dict:
    """The target's answer to the sync :func:`send_sync` sent last for this pair."""
    return _SENT.pop((source, target)).result()


def sync_then_close(caller, source: str, target: str) -> dict:
    """``sync_weights_async`` from ``source`` into ``target``, then ``close_llm(source)`` at once: the sync's answer,
    and whether ``target`` then holds the weights ``source`` had (every tensor of ``source`` that ``target`` has)."""
    import torch

    expected = caller.state_dict(llm=source)
    future = caller.sync_weights_async(source, target)
    caller.close_llm(source)
    answer = future.result()
    held = caller.state_dict(llm=target)
    shared = [k for k in expected if k in held]
    return {"answer": answer, "shared": len(shared), "equal": all(torch.equal(held[k], expected[k]) for k in shared)}
