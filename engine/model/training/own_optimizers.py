"""Optimizers of their own for the LoRA adapters created at run time where DeepSpeed owns the optimizer step
(ZeRO 1-3, or bfloat16): DeepSpeed builds its flat (and, in bfloat16, float32 master) copies of the trainable
parameters once, when the engine is built, so a parameter added later can never join them.

Such an adapter's parameters stay outside DeepSpeed: they are in no group of its optimizer, so its backward hooks,
reductions, clipping and steps never touch them (autograd fills their ``.grad`` during ``engine.backward``). Each
adapter gets an :class:`OwnOptimizer`: float32 master copies of its weights (the weights themselves where PEFT made them
float32), a torch optimizer of the config's kind over the masters, and a step that averages the adapter's gradients over
the LLM's replicas (one all-reduce of their flat float32 concatenation on the LLM's world, divided by its rank count:
the tensor-parallel ranks of a replica hold the same whole gradient, :mod:`llmrl.engine.model.tp_lora`), clips them to
the step's ``gradient_clipping`` by the adapter's own norm, steps the masters and copies them back into the weights. The
step's learning rate, betas, eps, weight decay and momentum are read from the engine's torch optimizer when it steps
(the config's ``lr_schedule`` and a script's ``optim_step`` settings land there). Its moments are its own, as a
configured adapter's group is (:mod:`llmrl.engine.model.training.optimizer`); a step that stops half-way or leaves a
non-finite value is undone with the others (:mod:`llmrl.engine.model.training.finite_steps` asks :func:`optimizer_for`
whose state a tensor has).

This module does not decide when to step (the trainer does: after DeepSpeed's step, only when DeepSpeed applied
it) nor create adapters (:mod:`llmrl.engine.model.training.new_adapters` does).
"""

from __future__ import annotations

import torch

OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum")


def torch_optimizer(groups, spec) -> torch.optim.Optimizer:
    """The torch optimizer the config names (``training.optimizer``) over ``groups`` (parameters or groups)."""
    if spec.type == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    cls = torch.optim.Adam if spec.type == "adam" else torch.optim.AdamW
    return cls(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


class OwnOptimizer:
    """One adapter's weights (name -> the model's tensor), their float32 masters and a torch optimizer over those."""

    def __init__(self, params: dict[str, torch.Tensor], spec):
        self.params = params
        self.masters = {k: p if p.dtype == torch.float32 else p.detach().float().clone() for k, p in params.items()}
        for master in self.masters.values():
            master.requires_grad_(True)
        self.optimizer = torch_optimizer(list(self.masters.values()), spec)
        self.last_norm: float | None = None

    def reduce_gradients(self, ranks: int, scale: float = 1.0) -> bool:
        """Every master's ``.grad``: its weight's gradient (zero where none) averaged over the LLM's ``ranks`` (each
        holds its replica's whole gradient: tensor-parallel ranks the same one, see :mod:`llmrl.engine.model.tp_lora`)
        and divided by the float16 loss ``scale`` (:mod:`llmrl.engine.model.training.loss_scale`); whether they are
        finite. Where they are not (a float16 overflow), none is kept: the gradients are dropped (collective: every
        rank of the LLM calls it, in the same order of adapters, and finds the same)."""
        grads = [p.grad.detach().float().reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in self.params.values()]
        flat = torch.cat(grads)
        if ranks > 1:
            import torch.distributed as dist

            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= ranks * scale
        if not bool(torch.isfinite(flat).all()):
            self.zero_grad()
            self.last_norm = None
            return False
        offset = 0
        for p, master in zip(self.params.values(), self.masters.values()):
            p.grad = None
            master.grad = flat[offset:offset + p.numel()].view_as(master).clone()
            offset += p.numel()
        return True

    def step(self, settings: dict, clip: float, record: list | None, owner: str) -> None:
        """Clip the reduced gradients to ``clip`` (0: not clipped), step with ``settings`` (a param group of the
        engine's torch optimizer), copy the masters into the weights. ``record``: where the stepped tensors and
        their state are copied first, to undo the step."""
        group = self.optimizer.param_groups[0]
        group.update({k: settings[k] for k in OPTIMIZER_KEYS if k in settings and k in group})
        masters = list(self.masters.values())
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in masters]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.last_norm = float(norm)
        with torch.no_grad():
            if clip and clip > 0:
                coefficient = clip / (norm + 1e-6)
                if coefficient < 1:
                    for g in grads:
                        g.mul_(coefficient)
            if record is not None:
                for m in masters:
                    state = {k: v.detach().clone() if torch.is_tensor(v) else v
                             for k, v in self.optimizer.state.get(m, {}).items()}
                    record.append((owner, m, m.detach().clone(), state))
            self.optimizer.step()
            for p, master in zip(self.params.values(), masters):
                if master is not p:
                    p.copy_(master)
                master.grad = None

    def zero_grad(self) -> None:
        for p, master in zip(self.params.values(), self.masters.values()):
            p.grad = master.grad = None

    def state_dict(self) -> dict:
        """A copy (torch's own state dict holds the live moments, which later steps change in place)."""
        import copy

        return {"masters": {k: m.detach().cpu().clone() for k, m in self.masters.items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        """Masters, moments and step counts as :meth:`state_dict` saved them; the weights follow the masters."""
        with torch.no_grad():
            for key, master in self.masters.items():
                master.copy_(state["masters"][key].to(master.device))
                if master is not self.params[key]:
                    self.params[key].copy_(master)
        self.optimizer.load_state_dict(state["optimizer"])

    def reset(self) -> None:
        """Masters from the weights (after they were written in place), fresh moments."""
        with torch.no_grad():
            for key, master in self.masters.items():
                if master is not self.params[key]:
                    master.copy_(self.params[key])
        self.optimizer.state.clear()


def own_optimizers(served) -> dict:
    """The run-time adapters' own optimizers of ``served``: adapter name -> :class:`OwnOptimizer`."""
    return served.run_time.optimizers


def optimizer_for(served, owner) -> torch.optim.Optimizer:
    """The torch optimizer holding the state of adapter ``owner``'s tensors (None: the shared group's)."""
    own = served.run_time.optimizers.get(owner)
    return own.optimizer if own is not None else served.adapter_steps.optimizer


def reduce_own(served, trained, scale: float = 1.0) -> tuple[list, list]:
    """Average the gradients of the run-time adapters in ``trained`` over the replicas, divided by the float16 loss
    ``scale``; returns those adapters' names, and the names of those whose gradients overflowed (dropped: their
    step is skipped) (collective; every rank of the LLM trains the same adapters in a step)."""
    names = [name for name in served.run_time.optimizers if name in trained]
    ranks = served.llm.replicas * served.llm.tensor_parallel
    overflowed = [name for name in names if not served.run_time.optimizers[name].reduce_gradients(ranks, scale)]
    return names, overflowed


def step_own(served, names, record: list | None) -> None:
    """Step the own optimizers of adapters ``names`` (after :func:`reduce_own`), with the engine's current settings."""
    settings = served.adapter_steps.optimizer.param_groups[0]
    clip = float(served.engine._config.gradient_clipping or 0.0)
    for name in names:
        served.run_time.optimizers[name].step(settings, clip, record, name)


def drop_own(served, names) -> None:
    """Drop the reduced gradients of the own optimizers of adapters ``names`` (a step that was skipped)."""
    for name in names:
        served.run_time.optimizers[name].zero_grad()


def steps_alone(served, own) -> bool:
    """Whether a step leaves DeepSpeed's step out: every adapter it trains steps with an optimizer of its own
    (``own``), and DeepSpeed ran no backward since its last step (another adapter's ``optim_step`` took it)."""
    trained = served.adapter_steps.trained if served.adapter_steps is not None else None
    return bool(own) and served.pending.engine_backwards == 0 and trained is not None and trained <= {None, *own}


def engine_step(served, own) -> bool:
    """DeepSpeed's step (its optimizer, clipping, schedule); whether it was applied. Left out when every adapter
    the step trains steps with an optimizer of its own and DeepSpeed ran no backward since its last step (another
    adapter's ``optim_step`` took it): DeepSpeed would find no gradient to finalize. The schedule and step count
    move on all the same, as they do for each ``optim_step`` at ZeRO 0."""
    engine = served.engine
    if steps_alone(served, own):
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None:
            scheduler.step()
        engine.global_steps += 1
        return True
    engine.step()
    served.pending.engine_backwards = 0
    return engine.was_step_applied()


def own_norm(served, names) -> float | None:
    """The norm of the (reduced, unclipped) gradients of the own optimizers of ``names`` at their last step."""
    norms = [served.run_time.optimizers[n].last_norm for n in names if n in served.run_time.optimizers]
    norms = [n for n in norms if n is not None]
    return float(sum(n * n for n in norms) ** 0.5) if norms else None
