"""The Caller's training calls: ``update`` (the LLM's updater on every replica) and the steps whose loss and
schedule live in the script (Tinker's primitives): ``forward_backward``, ``forward``, ``forward_backward_custom``
and ``optim_step``.

:class:`ClientTraining` is a part of :class:`~llmrl.engine.client.caller.Caller`: it is given the Caller's shared
:class:`~llmrl.engine.client.call_context.CallContext` (run, config, LLM descriptions) and its tracking part (each
``update`` and ``optim_step`` is a tracked step); the calls check their arguments here and hand them to the
``update``, ``forward_backward`` and ``optim_step`` request kinds. ``forward_backward_custom`` runs the script's loss
on the client: a forward pass gives the per-token log-probs, autograd gives d loss / d log-prob, and a
``cross_entropy`` pass weighted by minus those derivatives back-propagates ``sum(dL/dlogp * logp)``, whose gradient
is the loss's own.

This module computes no loss on the model (the servers do) and keeps no training state (the servers do).
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import TYPE_CHECKING

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType
from llmrl.engine.requests import forward_backward as fb_kind
from llmrl.engine.requests import optim_step as step_kind
from llmrl.engine.requests import update as update_kind
from llmrl.engine.requests.datums import check_data

if TYPE_CHECKING:
    from llmrl.engine.client.call_context import CallContext
    from llmrl.engine.client.tracking_calls import TrackingCalls


class ClientTraining:
    """``update``, ``forward_backward``, ``forward``, ``forward_backward_custom`` and ``optim_step``.

    Args:
        context: the Caller's shared run, config, LLM descriptions and wait.
        tracking: where each ``update`` and ``optim_step`` is written as a training step.
    """

    def __init__(self, context: CallContext, tracking: TrackingCalls):
        self._context: CallContext = context
        self._tracking: TrackingCalls = tracking

    def update_async(self, contexts, candidates=None, *, llm: str | None = None, **kwargs
                     ) -> concurrent.futures.Future:
        """Like :meth:`update`, returning a future."""
        name = self._context.open(llm)
        contexts, candidates = self._context.inputs(name, contexts, candidates)
        info = self._context.info.get(name, {})
        return update_kind.send(self._context.run, name, contexts, candidates, kwargs, info.get("per_sample"),
                           info.get("updater") or "", info.get("whole_args"))

    def update(self, contexts, candidates=None, *, llm: str | None = None, **kwargs) -> list[dict]:
        """Run the LLM's updater on every replica, each on its share of the batch. Contexts and candidates are
        strings or token ids as in :meth:`score`; the updater receives them as given (token ids as lists of ints)
        and may pass them to ``trainer.forward``.

        The updater's declared per-sample arguments (``Updater.per_sample_args``) are checked against the call and
        sliced like the contexts; for an updater that declares none, arguments whose length equals the number of
        contexts are. The others reach every replica whole. NaN or infinite numbers anywhere are refused.
        ``policy_versions`` (optional, any updater) holds one entry per context: the ``policy_version`` of its
        samples, as ``generate`` gave them (an int, or nested lists: :func:`llmrl.episode_batch` gives one per turn
        of each episode); the updater reads it in ``batch.kwargs``.

        Returns:
            The updater's statistics, one dict per replica (also written by the run's tracking, see :meth:`log`);
            with ``policy_versions``, each adds ``policy_version`` (the trained adapter's before the update) and
            its share's ``staleness_mean`` and ``staleness_max`` (that version minus the samples').
        """
        return self._tracking.tracked(llm, contexts, lambda: self.update_async(contexts, candidates, llm=llm, **kwargs))


    def _token_data(self, name: str, data, loss_fn: str | None, loss_fn_config):
        """The checked sequences and loss configuration of a call."""
        from llmrl.engine.token_losses import REGISTRY, token_loss_settings

        info = self._context.info.get(name, {})
        vocab_size, max_length = info.get("vocab_size"), info.get("max_length")
        if loss_fn is None:
            if loss_fn_config:
                raise InvalidArgument("loss_fn_config was given without a loss_fn")
            return check_data(data, None, vocab_size, max_length), {}
        if not isinstance(loss_fn, str):
            raise InvalidArgumentType(f"loss_fn must be the name of a registered loss ({', '.join(REGISTRY)}); "
                                      "for a Python function use forward_backward_custom")
        if loss_fn_config is not None and not isinstance(loss_fn_config, dict):
            raise InvalidArgumentType(f"loss_fn_config must be a dict, got {type(loss_fn_config).__name__}")
        try:
            token_loss_settings(loss_fn, loss_fn_config)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        loss = REGISTRY[loss_fn]
        return (check_data(data, loss.inputs, vocab_size, max_length, unread_when_zero=loss.unread_when_zero,
                           optional=loss.optional_inputs), dict(loss_fn_config or {}))

    def forward_backward_async(self, data, loss_fn: str, loss_fn_config: dict | None = None, *,
                               llm: str | None = None, peft_adapter: str | list[str] | None = None,
                               policy_versions=None) -> concurrent.futures.Future:
        """Like :meth:`forward_backward`, returning a future."""
        name = self._context.open(llm)
        if loss_fn is None:
            raise InvalidArgument("forward_backward needs a loss_fn (a built-in loss's name); forward(data) gives the "
                                  "log-probs alone")
        sequences, config = self._token_data(name, data, loss_fn, loss_fn_config)
        return fb_kind.send(self._context.run, name, sequences, loss_fn, config, backward=True, adapter=peft_adapter,
                            policy_versions=policy_versions)

    def forward_backward(self, data, loss_fn: str, loss_fn_config: dict | None = None, *, llm: str | None = None,
                         peft_adapter: str | list[str] | None = None, policy_versions=None) -> dict:
        """Compute a built-in loss on token-level data and its gradients; they accumulate on the servers, call
        after call, until :meth:`optim_step` applies them.

        Args:
            data: datums, each ``{"model_input": ids, "loss_fn_inputs": {"target_tokens": ids, ...}}``: the
                sequence's tokens but the last, the tokens but the first, and the loss's per-token inputs, one value
                per target token (:func:`llmrl.completion_datum` builds one from a prompt and a completion).
            loss_fn: ``"cross_entropy"`` (reads ``weights``: ``-weights * logp``), ``"importance_sampling"``
                (``logprobs`` of the sampler and ``advantages``: ``-exp(logp - logp_sampler) * A``), ``"ppo"``
                (the same inputs, the ratio clipped to ``[clip_low_threshold, clip_high_threshold]``, 0.8 and 1.2 by
                default), ``"cispo"`` (the clipped ratio, without gradient, weighs ``-A * logp``), ``"dro"``
                (``beta`` required: ``-(logp * A - beta / 2 * (logp - logp_sampler)^2)``), ``"gspo"`` (``ppo`` with the
                sequence's ratio, the geometric mean of the ratios of the tokens ``sequence_ratio_mask`` marks, on
                every token: GSPO-token).
            loss_fn_config: the loss's settings (thresholds, beta).
            peft_adapter: the LoRA adapter to train (default: the active one), or a list of one adapter's name per
                datum: the datums then run in one pass, each on its own adapter, and each adapter gets the gradients
                of its own datums (many tenants, or the runs of a sweep, on one base model).
            policy_versions: optional, one per datum: the ``policy_version`` of the samples it holds (an int, or a
                list of them: one per turn), as ``generate`` gave them; the metrics then report their staleness
                against the trained weights' version (``staleness:mean``, ``staleness:max``).

        The loss is the **sum** over every target token of every datum (weigh tokens through the inputs to get a
        mean). The LLM must be trainable (an updater, or ``trainable: true`` in its config).

        Returns:
            ``{"loss_fn_outputs": [{"logprobs": ..., "elementwise_loss": ...} per datum], "metrics":
            {"loss:sum": float}}``: each target token's log-prob under the weights before this call's gradients,
            and its loss (with ``policy_versions``, the metrics add ``staleness:mean`` and ``staleness:max``).
        """
        return self._context.wait(self.forward_backward_async(data, loss_fn, loss_fn_config, llm=llm,
                                                              peft_adapter=peft_adapter,
                                                              policy_versions=policy_versions))

    def forward_async(self, data, loss_fn: str | None = None, loss_fn_config: dict | None = None, *,
                      llm: str | None = None, peft_adapter: str | list[str] | None = None) -> concurrent.futures.Future:
        """Like :meth:`forward`, returning a future."""
        name = self._context.open(llm)
        sequences, config = self._token_data(name, data, loss_fn, loss_fn_config)
        return fb_kind.send(self._context.run, name, sequences, loss_fn, config, backward=False, adapter=peft_adapter)

    def forward(self, data, loss_fn: str | None = None, loss_fn_config: dict | None = None, *,
                llm: str | None = None, peft_adapter: str | list[str] | None = None) -> dict:
        """:meth:`forward_backward` without gradients: each datum's per-token log-probs (and, with ``loss_fn``, its
        per-token losses and their sum). With no ``loss_fn`` the datums need only ``model_input`` and
        ``target_tokens``; other inputs are not read. Pending gradients are left as they are."""
        return self._context.wait(self.forward_async(data, loss_fn, loss_fn_config, llm=llm, peft_adapter=peft_adapter))

    def forward_backward_custom(self, data, loss_fn, *, llm: str | None = None,
                                peft_adapter: str | list[str] | None = None) -> dict:
        """Gradients of any differentiable function of the per-token log-probs, computed in your script; they
        accumulate until :meth:`optim_step`, like :meth:`forward_backward`'s.

        ``loss_fn(data, logprobs) -> (loss, metrics)`` receives the datums and one 1-D tensor per datum (its target
        tokens' log-probs, with gradients) and returns a scalar tensor and a dict of floats. The servers run one
        forward pass to get the log-probs and one forward/backward pass whose gradient is the loss's (exact for a
        loss that reads the model only through these log-probs: DPO, SimPO, KL penalties).

        Returns:
            ``{"loss_fn_outputs": [{"logprobs": ...} per datum], "metrics": {**metrics, "loss": float}}``.
        """
        import torch

        if not callable(loss_fn):
            raise InvalidArgumentType(f"loss_fn must be a function (data, logprobs) -> (loss, metrics), got "
                                      f"{type(loss_fn).__name__}; built-in losses are named in forward_backward")
        name = self._context.open(llm)
        sequences, _ = self._token_data(name, data, None, None)
        forward = self.forward(data, llm=name, peft_adapter=peft_adapter)
        logprobs = [out["logprobs"].clone().requires_grad_(True) for out in forward["loss_fn_outputs"]]
        result = loss_fn(data, logprobs)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise InvalidArgumentType("loss_fn must return (loss, metrics): a scalar tensor and a dict of floats")
        loss, metrics = result
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
            raise InvalidArgument("loss_fn's loss must be a scalar tensor computed from the log-probs it was given")
        if not math.isfinite(float(loss.detach())):
            raise InvalidArgument(f"loss_fn's loss is {float(loss.detach())}; nothing was sent, no weight changed")
        try:
            metrics = {str(k): float(v) for k, v in dict(metrics or {}).items()}
        except (TypeError, ValueError) as err:
            raise InvalidArgument(f"loss_fn's metrics must be a dict of numbers ({err}); nothing was sent") from None
        grads = torch.autograd.grad(loss, logprobs, allow_unused=True)
        weighted = []
        for k, (seq, grad) in enumerate(zip(sequences, grads)):
            grad = torch.zeros(seq.num_targets) if grad is None else grad
            if not bool(torch.isfinite(grad).all()):
                raise InvalidArgument(f"the gradient of loss_fn's loss with respect to data[{k}]'s log-probs is not "
                                      "finite; nothing was sent, no weight changed")
            weighted.append({"model_input": seq.tokens[:-1],
                             "loss_fn_inputs": {"target_tokens": seq.tokens[1:], "weights": (-grad).tolist()}})
        self.forward_backward(weighted, "cross_entropy", llm=name, peft_adapter=peft_adapter)
        return {"loss_fn_outputs": forward["loss_fn_outputs"],
                "metrics": {**metrics, "loss": float(loss.detach())}}

    def optim_step_async(self, adam_params=None, *, llm: str | None = None, peft_adapter: str | None = None
                         ) -> concurrent.futures.Future:
        """Like :meth:`optim_step`, returning a future."""
        name = self._context.open(llm)
        settings = step_kind.check_step_settings(adam_params, self._context.config.llms[name].training.optimizer)
        return step_kind.send(self._context.run, name, step_kind.OptimStepRequest(settings, peft_adapter))

    def optim_step(self, adam_params=None, *, llm: str | None = None, peft_adapter: str | None = None) -> dict:
        """One optimizer step over the gradients accumulated by ``forward_backward`` calls since the last step.

        Args:
            adam_params: this step's hyperparameters, a dict (or ``tinker.AdamParams``) with any of
                ``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay`` and ``grad_clip_norm`` (global
                gradient-norm clip; 0: none). Those left out (or None) are the config's ``training.optimizer`` /
                ``training.gradient_clipping``: a schedule is a loop in your script that passes its learning rate.
                The optimizer type (Adam, AdamW, SGD) is the config's; each adapter has its own moments.
            peft_adapter: refuse the step if an adapter other than this one also has pending gradients (a step
                applies every pending gradient).

        Returns:
            ``{"optimizer_steps": 1 (0 when no gradient was pending), "adapters": [trained adapters],
            "grad_norm": the global gradient norm before clipping (None only with tensor parallelism under ZeRO 0),
            "policy_version": the trained adapter's version after the step (its optimizer steps)}``
            (also written by the run's tracking, as ``update``'s statistics are).

        Raises:
            InvalidArgument: a setting out of range, or (AdamW) ``learning_rate x weight_decay >= 1``, which zeroes
                or flips the weights.
            NonFiniteUpdate (from the servers): a gradient was not finite (no step), or the step left a weight or
                moment that is not finite: the step is undone (where LoRA adapters train), the adapter's pending
                gradients are discarded, every other adapter's are kept where they can be (ZeRO 0 in float32; adapters
                created at run time, at ZeRO 0-3).
        """
        return self._tracking.tracked(llm, None, lambda: self.optim_step_async(adam_params, llm=llm,
                                                                               peft_adapter=peft_adapter))
