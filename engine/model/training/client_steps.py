"""Training steps whose loss and schedule belong to the script: ``forward_backward`` and ``optim_step`` on a replica.

``forward_backward`` runs the model over a share of token-level sequences through the same
:class:`~llmrl.engine.model.training.trainer.EngineTrainer` an updater gets (so passes bounded by tokens, votes
between replicas, non-finite checks and per-adapter bookkeeping are the ones of ``update``), computes a built-in
per-token loss (:func:`llmrl.engine.token_losses.token_loss`) and back-propagates its **sum** over the share.
DeepSpeed averages gradients over the replicas, so each replica's sum is multiplied by their number: the reduced
gradient is the gradient of the loss summed over the whole call, as Tinker defines it. Gradients are not applied:
they accumulate on the engine, call after call, and the :class:`ServedModel` remembers how many backward passes
and which adapters are pending, until ``optim_step`` takes one optimizer step over them, with the learning rate,
betas, eps, weight decay and clipping the script gave for that step (:func:`step_settings`; the config's values
are restored after it).

Gradients are pending per adapter (a Tinker training client is one). Where they sit on the parameters themselves
(ZeRO 0 in float32, nothing trained outside the adapters: :func:`isolated`), ``optim_step(adapter=X)`` steps X
alone while the other adapters' gradients are set aside and put back, and a failed call of X (out of memory on one
replica, a non-finite loss) discards X's pending gradients only. So it is between adapters created at run time that
step with optimizers of their own (ZeRO 1-3, bfloat16: :func:`separable`), whose gradients stay on their
parameters. Elsewhere (ZeRO 1-3 and half precision keep
gradients in DeepSpeed's own buffers) a failed call discards every adapter's, and each adapter whose gradients went
with it is told at its next call, which is refused once; ``optim_step(adapter=X)`` is refused while another
adapter's gradients are pending. ``update`` is refused while gradients are pending.

This module does not check the client's data (:mod:`llmrl.engine.requests.datums` does) nor choose a loss, and it
reads no request: the request kinds (:mod:`llmrl.engine.requests.forward_backward`, ``optim_step``) unpack theirs
into plain arguments.
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.engine.adapter_names import ContextAdapters
from llmrl.engine.errors import PeerAborted
from llmrl.engine.graph import keep_in_graph
from llmrl.engine.model.cpu_matmul import frozen_linears
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.training.grad_norm import recorded_norm
from llmrl.engine.model.training.loss_scale import loss_scale, rescale, unscaled_norm
from llmrl.engine.model.training.optimizer import ADAPTER_KEY, adapter_of
from llmrl.engine.model.training.own_optimizers import own_norm
from llmrl.engine.model.training.replica_votes import END
from llmrl.engine.model.training.trainer import EngineTrainer
from llmrl.engine.token_losses import token_loss


def _trainer(served: ServedModel, what: str) -> EngineTrainer:
    """A trainer that carries on from the gradients pending on ``served``."""
    if served.adapter_steps is None:
        name = served.llm.name
        raise ValueError(f"{what} trains LLM {name!r}, which holds no optimizer: set llms.{name}.trainable: true in "
                         "the config (an LLM with an updater is trainable too)")
    trainer = EngineTrainer(served)
    trainer.pending_micro_steps = served.pending.backwards
    trainer.trained_adapters = set(served.pending.adapters)
    return trainer


def isolated(served: ServedModel) -> bool:
    """Whether each adapter's pending gradients can be stepped or discarded apart from the others': they sit on the
    parameters (ZeRO 0 with the plain torch optimizer: no DeepSpeed buffers), and no parameter outside the adapters
    trains (a head's gradients would mix every adapter's)."""
    steps = served.adapter_steps
    if served.llm.training.zero_stage != 0 or served.engine.optimizer is not steps.optimizer:
        return False
    return not any(p.requires_grad for g in steps.optimizer.param_groups if g.get(ADAPTER_KEY) is None
                   for p in g["params"])


def separable(served: ServedModel, adapters) -> bool:
    """Whether the pending gradients of ``adapters`` can be stepped or discarded apart from each other's:
    :func:`isolated`, or each is an adapter created at run time with an optimizer of its own (its gradients on its
    own parameters, outside DeepSpeed's buffers) and no parameter outside the adapters trains."""
    if isolated(served):
        return True
    own = served.run_time.optimizers
    if not own or not all(a in own for a in adapters):
        return False
    return not any(p.requires_grad and adapter_of(name, served.adapters) is None
                   for name, p in served.module.named_parameters())


@contextlib.contextmanager
def set_aside(served: ServedModel, adapters, added_back: bool = False):
    """Inside, the gradients of ``adapters`` are off their parameters (no step or discard sees them); put back after,
    or, with ``added_back``, added to what the parameters then hold (a call's new gradients, or nothing where those
    were discarded)."""
    saved = _pending_grads(served, adapters)
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad if p.grad is None or not added_back else p.grad + grad


def _pending_grads(served: ServedModel, adapters) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """The parameters of ``adapters`` that hold a gradient, with it."""
    saved = [(p, p.grad) for g in served.adapter_steps.optimizer.param_groups if g.get(ADAPTER_KEY) in adapters
             for p in g["params"] if p.grad is not None]
    return saved + [(p, p.grad) for a in adapters if a in served.run_time.optimizers
                    for p in served.run_time.optimizers[a].params.values() if p.grad is not None]


def _discard(served: ServedModel, trainer: EngineTrainer, adapter: str | None) -> str:
    """Forget the pending gradients of ``adapter`` (the failed call's), and every other adapter's unless
    :func:`isolated`; returns what to tell the script."""
    before = dict(served.pending.adapters)
    if adapter is None:  # a step of every adapter failed: each one's gradients were the call's own
        trainer.discard_partial_accumulation()
        served.pending.keep(())
        earlier = sum(before.values())
        return (f"the gradients of the {earlier} earlier forward_backward call(s) since the last optim_step were "
                "discarded on every replica") if earlier else "no gradient was pending"
    failed = set(adapter) if isinstance(adapter, tuple) else {adapter}  # a tuple: a call of several adapters
    label = f"adapter {adapter!r}" if not isinstance(adapter, tuple) else f"adapters {sorted(failed, key=str)}"
    others = {a for a in before if a not in failed} if separable(served, before) else set()
    with set_aside(served, others):
        trainer.discard_partial_accumulation()
    lost = {a: n for a, n in before.items() if a not in others}
    served.pending.keep(others)
    for other in lost:
        if other not in failed:
            served.pending.discarded[other] = (
                f"the gradients of adapter {other!r}'s {lost[other]} forward_backward call(s) since its last "
                f"optim_step were discarded when a call on {label} failed (ZeRO 1-3 and half precision "
                "hold every adapter's gradients together); nothing was run: send them again")
    kept = f" (those of {sorted(others, key=str)} are kept)" if others else ""
    earlier = sum(lost.get(a, 0) for a in failed)
    if not earlier:
        return f"no gradient of {label} was pending{kept}"
    their = "their" if isinstance(adapter, tuple) else "its"
    return (f"the gradients of the {earlier} earlier forward_backward call(s) of {label} since {their} "
            f"last optim_step were discarded on every replica{kept}")


def _refuse_discarded(served: ServedModel, adapters) -> None:
    """Tell adapters, once, that another's failed call discarded their pending gradients."""
    told = [served.pending.discarded.pop(adapter) for adapter in list(adapters) if adapter in served.pending.discarded]
    if told:
        raise ValueError("; ".join(told))


def forward_backward(served: ServedModel, tokens: list[list[int]], inputs: list[dict[str, list[float]]],
                     loss_fn: str | None, loss_fn_config: dict, backward: bool, adapter) -> dict:
    """One replica's share of a ``forward_backward`` (``backward``) or ``forward`` call: per sequence (its
    ``tokens`` and its per-token loss ``inputs``), the log-probs of its targets and their per-token losses under
    ``loss_fn`` (None: log-probs only), and the share's summed loss. ``adapter``: the adapter to run (None: the
    active one), or a :class:`~llmrl.engine.model.token_adapters.ContextAdapters` naming each sequence's (one pass
    for them all, each token on its sequence's adapter; each adapter's gradients its own sequences')."""
    what = "forward_backward" if backward else "forward"
    mixed = isinstance(adapter, ContextAdapters)
    trained = adapter.call if mixed else adapter or served.active_adapter()
    if served.llm.type != "causal":
        raise ValueError(f"{what} reads next-token log-probs of a causal model; LLM {served.llm.name!r} is "
                         f"{served.llm.type}")
    if backward:
        _refuse_discarded(served, trained if mixed else [trained])
    trainer = _trainer(served, what) if backward else EngineTrainer(served)
    trainer.trained_adapters = set()  # this call's
    contexts = [seq[:1] for seq in tokens]
    candidates = [[seq[1:]] for seq in tokens]
    # a call of several adapters that can each be stepped alone holds their earlier gradients apart: a failure then
    # discards this call's gradients only, and a success adds them to the earlier ones
    apart = mixed and backward and separable(served, {*served.pending.adapters, *trained})
    with set_aside(served, trained, added_back=True) if apart else contextlib.nullcontext():
        try:
            with torch.set_grad_enabled(backward), frozen_linears(served.module):  # its backward pass too
                out = trainer.forward(contexts, candidates, peft_adapter=adapter, per_token=True)
                logprobs = list(out.token_logprobs.float().split(out.candidate_token_counts.tolist()))
                losses = [token_loss(loss_fn, lp, _tensors(given, lp.device), loss_fn_config)
                          for lp, given in zip(logprobs, inputs)] if loss_fn is not None else []
                total = sum((loss.sum() for loss in losses), torch.zeros((), dtype=torch.float32))
                if backward:
                    trainer.backward(keep_in_graph(total, out.token_logprobs) * served.llm.replicas)
            trainer.votes.check_peers(True, END)
        except Exception as err:
            if not isinstance(err, PeerAborted) and not trainer.failed_vote_cast:
                trainer.votes.check_peers(False, END)
            if not backward:
                raise
            note = _discard_call(served, trainer, trained) if apart else _discard(served, trainer, trained)
            raise _noted(err, note) from None
    if backward:
        served.pending.backwards += 1
        for name in trainer.trained_adapters or {None}:
            served.pending.adapters[name] = served.pending.adapters.get(name, 0) + 1
    outputs = [{"logprobs": lp.detach().cpu(), "elementwise_loss": loss.detach().float().cpu()} if losses else
               {"logprobs": lp.detach().cpu()} for lp, loss in zip(logprobs, losses or logprobs)]
    return {"outputs": outputs, "loss": float(total.detach())}


def _discard_call(served: ServedModel, trainer: EngineTrainer, adapters) -> str:
    """Forget the gradients a failed call of ``adapters`` left (their earlier ones held apart, every other
    adapter's set aside)."""
    with set_aside(served, set(served.pending.adapters) - set(adapters)):
        trainer.discard_partial_accumulation()
    return (f"this call's gradients were discarded on every replica; the earlier gradients of adapters "
            f"{sorted(adapters, key=str)} are kept")


def optim_step(served: ServedModel, settings: dict, adapter: str | None) -> dict:
    """One optimizer step over the pending gradients, with ``settings`` (Tinker's AdamParams names) for this step.
    ``adapter``: refuse when another adapter also has pending gradients (it would be stepped too)."""
    trainer = _trainer(served, "optim_step")
    others: list = []
    if adapter is not None:
        served.check_adapter(adapter)
        if adapter not in served.adapters:
            raise ValueError(f"{adapter!r} is a snapshot: it has no gradients and takes no step")
        _refuse_discarded(served, [adapter])
        others = sorted((a for a in served.pending.adapters if a != adapter), key=str)
        if others and not separable(served, [adapter, *others]):
            raise ValueError(f"optim_step(adapter={adapter!r}) would also step adapter(s) {others}, whose "
                             "forward_backward gradients are pending too (under ZeRO 1-3 or half precision an "
                             "optimizer step takes every pending gradient); call optim_step() without adapter= to "
                             "step them all, or step each before training the next")
        trainer.trained_adapters = {adapter} & set(served.pending.adapters)
        trainer.pending_micro_steps = served.pending.adapters.get(adapter, 0)
    else:
        _refuse_discarded(served, list(served.pending.discarded))
    if trainer.pending_micro_steps == 0:
        return {"optimizer_steps": 0, "adapters": [], "grad_norm": None}
    trained, scale = set(trainer.trained_adapters), loss_scale(served.engine)
    try:
        with set_aside(served, others), step_settings(served, settings), recorded_norm(served.engine) as recorded:
            skipped = trainer.flush()
    except Exception as err:
        raise _noted(err, _discard(served, trainer, adapter))  # noqa: B904 - the same error, its message completed
    finally:  # float16: the gradients kept pending take a scale the step changed (also where it failed after)
        rescale([grad for _, grad in _pending_grads(served, others)], loss_scale(served.engine) / scale)
    served.pending.keep(others)
    stepped = sorted(a for a in trained if a is not None and a not in skipped)
    said = {"skipped": sorted(skipped, key=str), "loss_scale": loss_scale(served.engine)} if skipped else {}
    if skipped and skipped >= trained:  # float16: the gradients overflowed (dropped); the loss scale is lowered
        return {"optimizer_steps": 0, "adapters": [], "grad_norm": None, **said}
    norm = served.engine.get_global_grad_norm() if hasattr(served.engine, "get_global_grad_norm") else None
    norm = float(norm) if isinstance(norm, (int, float, torch.Tensor)) else recorded.get("norm")
    norm = unscaled_norm(served.engine, norm, scale)
    own = own_norm(served, stepped)  # adapters created at run time step outside DeepSpeed's norm
    if own is not None:
        norm = own if norm is None else (norm * norm + own * own) ** 0.5
    return {"optimizer_steps": 1, "adapters": stepped, "grad_norm": norm, **said}


@contextlib.contextmanager
def step_settings(served: ServedModel, settings: dict):
    """Inside, the optimizer's groups use ``settings`` (``learning_rate``, ``beta1``, ``beta2``, ``eps``,
    ``weight_decay``) and DeepSpeed clips at ``grad_clip_norm`` (0: no clipping); the config's values come back
    after, for the settings given only. The learning rate belongs to the config's ``lr_schedule`` where one is set
    (DeepSpeed steps the scheduler inside, after the optimizer): without ``learning_rate`` it is left alone, and
    with it the group's rate after the step is the schedule's for the next step (putting back the one from before
    the step would hold a warm-up at its first rate for ever; so would keeping the script's when the scheduler
    happened to set the same)."""
    groups = served.adapter_steps.optimizer.param_groups
    names = {"learning_rate": "lr", "beta1": "betas", "beta2": "betas", "eps": "eps", "weight_decay": "weight_decay"}
    changed = {names[key] for key in settings if key in names}
    saved = [dict((k, g[k]) for k in changed if k in g) for g in groups]
    engine = served.engine
    zero_optimizer = engine.optimizer if hasattr(engine.optimizer, "clip_grad") else None
    clipping = engine._config.gradient_clipping, getattr(zero_optimizer, "clip_grad", None)
    try:
        for group in groups:
            if "learning_rate" in settings:
                group["lr"] = settings["learning_rate"]
            if "betas" in group and ("beta1" in settings or "beta2" in settings):
                beta1, beta2 = group["betas"]
                group["betas"] = (settings.get("beta1", beta1), settings.get("beta2", beta2))
            if "eps" in settings and "eps" in group:
                group["eps"] = settings["eps"]
            if "weight_decay" in settings:
                group["weight_decay"] = settings["weight_decay"]
        if "grad_clip_norm" in settings:
            engine._config.gradient_clipping = settings["grad_clip_norm"]
            if zero_optimizer is not None:
                zero_optimizer.clip_grad = settings["grad_clip_norm"]
        yield
    finally:
        scheduler = getattr(engine, "lr_scheduler", None)
        factor = scheduler.lr_lambdas[0](max(scheduler.last_epoch, 0)) if getattr(scheduler, "lr_lambdas", None) \
            else None
        for group, values in zip(groups, saved):
            if "lr" in values and factor is not None and "initial_lr" in group:
                values["lr"] = group["initial_lr"] * factor  # the schedule's next rate, whether or not it stepped
            elif "lr" in values and group["lr"] != settings["learning_rate"]:
                del values["lr"]  # another scheduler (training.deepspeed's) moved it on: the next rate is its own
            group.update(values)
        engine._config.gradient_clipping = clipping[0]
        if zero_optimizer is not None:
            zero_optimizer.clip_grad = clipping[1]


def _noted(err: Exception, note: str) -> Exception:
    """``err`` with ``note`` appended to its message (the same type and traceback)."""
    err.args = (f"{err}; {note}",)
    return err


def _tensors(inputs: dict[str, list[float]], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(values, dtype=torch.float32, device=device) for key, values in inputs.items()}
