"""An optimizer step that leaves no NaN or infinity behind: what the step is about to change is copied, and when,
after it, a weight or an optimizer moment it touched is not finite on any rank of the LLM, every rank puts back
what the step changed and raises :class:`NonFiniteUpdate` naming the adapter. A step that raises half-way (torch
refuses a scalar that overflows float32, after advancing some step counts) is put back too.

Finite gradients do not make a finite step: AdamW's decay ``1 - lr * weight_decay`` or a learning rate near the
float range overflows the weights, and a huge gradient overflows Adam's second moment. Left in place, such values
make every later step of that adapter fail, and its state is saved that way. The copy covers the groups the step
takes (:class:`~llmrl.engine.model.training.optimizer.AdapterSteps` records the tensors the torch optimizer steps,
and their state: the parameters themselves at ZeRO 0 in float32, DeepSpeed's float32 partitions under ZeRO 1-3 or
half precision, whose model weights are copied here too, and the float32 masters of adapters created at run time
that step with an optimizer of their own, :mod:`llmrl.engine.model.training.own_optimizers`). It is made only where
LoRA adapters train (a few tensors); an LLM trained without adapters is checked the same, but the step is not
undone (a copy would double the model's memory): the error says so. The engine's step count and learning-rate
schedule still move on.
A kept step counts one policy version for each adapter it trained (:mod:`llmrl.engine.model.version_counts`).

This module does not decide when to step (the trainer does) nor which groups a step takes (the optimizer does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from llmrl.engine.model.training.optimizer import adapter_of
from llmrl.engine.model.training.own_optimizers import optimizer_for
from llmrl.engine.model.version_counts import count_step


class NonFiniteUpdate(FloatingPointError):
    """A loss, gradient or stepped value was not finite: no replica kept the optimizer step."""


@dataclass
class StepCopy:
    """What a step touched: the model's weights of the stepped groups (name, the tensor this rank holds, a copy from
    before the step or None), and, filled in by the optimizer's step, each tensor it stepped (adapter, tensor,
    copy, copy of its state)."""

    model: list = field(default_factory=list)
    stepped: list | None = None  # None: nothing is copied (no undo)
    trained: frozenset = frozenset()  # the adapters the step trains (none: the model without adapters)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of a weight this rank holds (ZeRO-3's partition, or the weight)."""
    return getattr(p, "ds_tensor", p)


@contextlib.contextmanager
def copied_step(served, trained):
    """Inside, an optimizer step over the shared group and the groups of adapters ``trained`` is recorded; yields the
    :class:`StepCopy`."""
    steps, adapters = served.adapter_steps, list(served.adapters)
    taken = {None, *trained}
    undoable = bool(adapters) and steps is not None
    master = steps is not None and served.engine.optimizer is not steps.optimizer  # DeepSpeed's own copies
    copy = StepCopy(stepped=[] if undoable else None, trained=frozenset(trained))
    with torch.no_grad():
        for name, p in served.module.named_parameters():
            if p.requires_grad and adapter_of(name, adapters) in taken:
                local = _local(p)
                copy.model.append((name, local, local.detach().clone() if undoable and master else None))
    if steps is not None:
        steps.record = copy.stepped
    try:
        yield copy
    except Exception as err:  # torch stopped inside the step (a scalar that overflows float32, say): a part was taken
        if copy.stepped is not None:
            undo(served, copy)
            names = sorted({adapter_of(name, adapters) for name, _, _ in copy.model} - {None})
            err.args = (f"{err}; the optimizer step stopped half-way and was undone (adapter(s) {names} hold the "
                        "weights and optimizer moments of before it): lower this step's learning_rate",)
        raise
    finally:
        if steps is not None:
            steps.record = None


def first_non_finite(served, copy: StepCopy) -> str | None:
    """The first weight or optimizer moment of the step that holds a NaN or an infinity, named, or None."""
    tensors = [(f"weight {name}", t) for name, t, _ in copy.model]
    for owner, p, _, _ in copy.stepped or []:
        whose = "the shared weights'" if owner is None else f"adapter {owner!r}'s"
        state = optimizer_for(served, owner).state.get(p, {})
        tensors += [(f"{whose} optimizer state {k} ({tuple(p.shape)})", v)
                    for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()]
        tensors.append((f"{whose} stepped tensor ({tuple(p.shape)})", p))
    if not tensors:
        return None
    device = tensors[0][1].device  # one synchronisation for them all
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in tensors])
    if bool(finite.all()):
        return None
    what, t = tensors[int((~finite).nonzero()[0])]
    return f"{what}: {'nan' if bool(torch.isnan(t).any()) else 'inf'}"


def undo(served, copy: StepCopy) -> None:
    """Put back every tensor and optimizer state the step changed."""
    with torch.no_grad():
        for owner, p, data, state in copy.stepped:
            optimizer = optimizer_for(served, owner)
            p.copy_(data)
            if state:
                optimizer.state[p] = state
            else:
                optimizer.state.pop(p, None)
        for _, t, data in copy.model:
            if data is not None:
                t.copy_(data)


def keep_finite(trainer, copy: StepCopy, vote) -> None:
    """After the step: the ranks vote (``vote(value)`` returns the largest) on whether it left a non-finite value;
    if one did, every rank undoes it (where it was copied) and raises."""
    served = trainer.served
    bad, replicas = first_non_finite(served, copy), served.llm.replicas
    voted = vote(0 if bad is None else replicas - served.role.replica)  # the largest: the first bad replica
    if not voted:
        count_step(served, copy.trained)  # kept: the trained adapters' policy versions move on
        return
    trainer.failed_vote_cast = True  # every rank raises here
    bad_replica = replicas - voted
    number, where = trainer.optimizer_steps + 1, f" ({bad})" if bad is not None else ""
    adapters = sorted({adapter_of(name, served.adapters) for name, _, _ in copy.model} - {None})
    whose = f"adapter(s) {adapters}" if adapters else f"LLM {served.llm.name!r}"
    if copy.stepped is None:
        raise NonFiniteUpdate(f"optimizer step {number} left a value that is not finite on replica "
                              f"{bad_replica}{where}; {whose} now hold it (a step is undone only where LoRA "
                              "adapters train): load a checkpoint, and lower learning_rate / weight_decay")
    undo(served, copy)
    raise NonFiniteUpdate(f"optimizer step {number} left a value that is not finite on replica {bad_replica}"
                          f"{where}: the step was undone on every replica ({whose} hold the weights and optimizer "
                          "moments of before it); lower this step's "
                          "learning_rate / weight_decay, or clip the gradients (grad_clip_norm)")
