"""The ``update`` request kind, behind ``Caller.update``: the LLM's updater runs on every replica, each on its share.

Client half: samples are split evenly across replicas. Keyword arguments are checked (no optimizer setting such as
``lr`` or ``max_grad_norm``, which the config owns and an updater would silently ignore,
:func:`refuse_engine_settings`; every number finite, :mod:`llmrl.engine.requests.finite`; the updater's declared
per-sample arguments shaped like the call, :mod:`llmrl.plugins.per_sample`) before anything is sent; the
per-sample ones (declared, or by the length rule for an updater that declares nothing) are sliced like the
contexts, the others reach every replica whole. ``policy_versions`` (one per sample: the policy versions of the
samples, :mod:`llmrl.engine.policy_versions`) is taken by every updater and sliced with the samples; the server
adds the staleness statistics to each replica's. Every replica takes part, even with no sample (its collectives
must line up with the others'). Server half: the backend runs the updater on the share's
:class:`~llmrl.plugins.contracts.UpdateBatch` (:meth:`UpdateRequest.batch`); each replica's leader answers with its
stats.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.policy_versions import check_policy_versions
from llmrl.engine.requests.base import Kind, Run, replica_parts, split_evenly
from llmrl.engine.requests.finite import check_finite, check_numbers
from llmrl.plugins.contracts import UpdateBatch
from llmrl.plugins.per_sample import check_per_sample, per_sample_keys, positional, take_samples

NAME = "update"

# Settings that trainer libraries take with each training call (trlX's and TRL's configs, Lamorel users' own
# updaters) and that llmrl's config owns: where each one goes, under llms.<name>.
_LR = "training.optimizer.lr (a schedule: training.lr_schedule)"
_CLIP = "training.gradient_clipping"
ENGINE_SETTINGS = {
    "lr": _LR, "learning_rate": _LR, "max_grad_norm": _CLIP, "grad_clip": _CLIP, "clip_grad_norm": _CLIP,
    "gradient_clipping": _CLIP, "max_norm": _CLIP, "weight_decay": "training.optimizer.weight_decay",
    "betas": "training.optimizer.betas", "adam_epsilon": "training.optimizer.eps", "optimizer": "training.optimizer",
    "scheduler": "training.lr_schedule", "lr_scheduler": "training.lr_schedule", "lr_schedule": "training.lr_schedule",
    "warmup_steps": "training.lr_schedule.warmup_steps",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
}


def refuse_engine_settings(kwargs: dict, llm: str, declared: dict | None, updater: str) -> None:
    """Refuse (:class:`InvalidArgument`) an optimizer, clipping or schedule setting passed to ``update``, unless the
    updater declares it: the engine's optimizer reads the config, so the updater would ignore it without a word. The
    message says where it goes in the config."""
    for key in kwargs:
        if key in ENGINE_SETTINGS and key not in (declared or {}):
            where = ENGINE_SETTINGS[key].replace("training.", f"llms.{llm}.training.")
            raise InvalidArgument(f"update argument {key!r} would be ignored: the updater {updater or '(none)'!r} "
                                  f"does not read it, and the optimizer, clipping and learning-rate schedule are "
                                  f"set in the config: {where} (on the command line: llmrl run --config run.yaml "
                                  f"{where.split(' ')[0]}=VALUE script.py); nothing was sent")


def refuse_unknown(kwargs: dict, declared: dict | None, whole, updater: str) -> None:
    """Refuse (:class:`InvalidArgument`) a keyword argument the updater does not read, when it lists what it reads
    (``per_sample_args`` and ``whole_args`` both declared): ignored without a word, a misspelt ``old_logprob`` would
    train on something else than the caller meant."""
    if declared is None or whole is None:
        return
    known = [*declared, *whole]
    unknown = [key for key in kwargs if key not in known]
    if unknown:
        raise InvalidArgument(f"update argument(s) {unknown} are not read by the updater {updater!r}: it reads "
                              f"{', '.join(known) or 'no keyword argument'}; check the spelling; nothing was sent")


@dataclass(frozen=True)
class UpdateRequest:
    """One replica's share of an update call."""

    contexts: list[str | list[int]]  # text, or token ids used as given
    candidates: list[list[str | list[int]]] | None
    kwargs: dict = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)  # positions of these samples in the whole call
    global_size: int = 0
    replica_sizes: list[int] = field(default_factory=list)
    per_sample: list[str] = field(default_factory=list)  # the kwargs sliced with the samples

    def batch(self, replica: int, num_replicas: int) -> UpdateBatch:
        """What the updater receives: this share as replica ``replica`` of ``num_replicas``."""
        return UpdateBatch(contexts=self.contexts, candidates=self.candidates, kwargs=self.kwargs,
                           indices=self.indices, global_size=self.global_size, replica=replica,
                           num_replicas=num_replicas, replica_sizes=self.replica_sizes,
                           per_sample_keys=tuple(self.per_sample))


def send(run: Run, llm: str, contexts: list, candidates: list[list] | None, kwargs: dict,
         declared: dict | None = None, updater: str = "", whole: list | tuple | None = None) -> Future:
    """``declared``: the updater's ``per_sample_args`` declaration, as its servers described it (None: the length
    rule); ``whole``: its ``whole_args`` (None: any other argument is accepted)."""
    # a declared per-sample argument given as None is not given (``old_logprobs=lp if cached else None``)
    kwargs = {k: positional(v) for k, v in kwargs.items() if not (v is None and k in (declared or {}))}
    if not contexts:  # an optimizer step on no data still moves the weights (Adam's momentum, weight decay)
        raise InvalidArgument(f"update got no contexts: there is nothing to learn from, and the updater "
                              f"{updater or '(none)'!r} would still take an optimizer step; skip the call when a "
                              "batch is empty; nothing was sent")
    versions = kwargs.pop("policy_versions", None)  # read by every updater's engine: no declaration needed
    refuse_engine_settings(kwargs, llm, declared, updater)
    refuse_unknown(kwargs, declared, whole, updater)
    check_finite(kwargs)
    check_per_sample(kwargs, contexts, candidates, declared, updater)
    check_numbers(kwargs, declared, updater)
    n = len(contexts)
    keys = per_sample_keys(kwargs, n, declared)
    if versions is not None:
        try:
            kwargs["policy_versions"] = check_policy_versions(versions, n, "update argument 'policy_versions'")
        except ValueError as err:
            raise InvalidArgument(f"{err}; nothing was sent") from None
        keys.append("policy_versions")
    bounds = split_evenly(n, len(run.replicas(llm)))
    sizes = [stop - start for start, stop in bounds]

    def share(start: int, stop: int) -> UpdateRequest:
        sliced = {k: (take_samples(v, range(start, stop)) if k in keys else v) for k, v in kwargs.items()}
        return UpdateRequest(contexts[start:stop], None if candidates is None else candidates[start:stop], sliced,
                             list(range(start, stop)), n, sizes, keys)

    parts, leaders = replica_parts(run, llm, bounds, share, keep_empty=True)
    return run.submit(NAME, parts, lambda values: [values[leader] for leader in leaders])


def handle(replica, request: UpdateRequest):
    stats = replica.backend.update(request)
    return stats if replica.answers else None


KIND = Kind(name=NAME, payload=UpdateRequest, send=send, handle=handle, backend_method="update",
            caller_methods=("update_async", "update"))
