"""The per-token losses of client-owned training steps (``forward_backward``) and their registry: each loss is a
function declared once with :func:`register_token_loss` (its name, the per-token inputs it reads, its configuration's
defaults, the inputs a datum may add and those that, all 0 at a position, leave it unread), next to its maths. The
built-in ones are ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro`` and ``gspo``, with Tinker's
names, inputs and definitions. :func:`token_loss` computes a registered loss, :func:`token_loss_settings` checks its
configuration, :func:`clipped_ratio_loss` is PPO's clipped surrogate (one definition, on ratio bounds, that
:func:`llmrl.plugins.rl_math.clipped_surrogate` also uses), and :data:`TOKEN_LOSSES`, :data:`OPTIONAL_INPUTS` and
:data:`UNREAD_WHEN_ZERO` are read-only views of the registry.

Another package adds a loss with one module and one line: the module defines the function under
``@register_token_loss("name", inputs=...)``, and its ``pyproject.toml`` names that function in the entry-point
group ``llmrl.token_losses`` (``name = "package.module:function"``); the registry imports it on first use, on the
client and on every replica.

Pure functions of tensors, at the engine's level because the engine serves these losses itself (the client checks a
call's loss, a replica computes it, the Tinker service accepts its name); :mod:`llmrl.plugins.rl_math` re-exports
them for plugins and scripts. Nothing here reads a request, calls the model or checks a datum
(:mod:`llmrl.engine.requests.datums` does).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RegisteredLoss:
    """One registered loss: ``compute(logprobs, inputs, settings)`` gives its per-token losses ``[T]``."""

    name: str
    compute: Callable[[torch.Tensor, dict, dict], torch.Tensor]
    inputs: tuple[str, ...]  # the per-token inputs it reads besides the log-probs
    config: dict = field(default_factory=dict)  # its configuration's keys, with the defaults (None: required)
    optional_inputs: tuple[str, ...] = ()  # per-token inputs a datum may add
    unread_when_zero: tuple[str, ...] = ()  # all 0 at a position: its loss and gradient there are 0 (): none such


ENTRY_POINT_GROUP = "llmrl.token_losses"  # another package's losses: each entry point names a registered function


class _Registry(Mapping):
    """The registered losses by name. The first read imports the functions named in the entry-point group
    :data:`ENTRY_POINT_GROUP` (their modules register them with :func:`register_token_loss`), in every process that
    reads it: the client that checks a call and the replicas that compute it alike."""

    def __init__(self):
        self._losses: dict[str, RegisteredLoss] = {}
        self._loaded = False

    def add(self, loss: RegisteredLoss) -> None:
        if loss.name in self._losses:
            raise ValueError(f"a token loss named {loss.name!r} is already registered")
        self._losses[loss.name] = loss

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        from llmrl.engine.entry_points import entry_points

        for entry in entry_points(ENTRY_POINT_GROUP):
            try:
                function = entry.load()
            except Exception as err:  # noqa: BLE001 - re-raised naming the entry point
                raise ImportError(f"the token loss {entry.name!r} ({entry.value}, entry point group "
                                  f"{ENTRY_POINT_GROUP!r}) failed to import: {err}") from err
            if entry.name not in self._losses or self._losses[entry.name].compute is not function:
                raise ValueError(f"the entry point {entry.name!r} of {ENTRY_POINT_GROUP!r} names {entry.value}, which "
                                 f"is not registered as the token loss {entry.name!r}: decorate it with "
                                 f"@register_token_loss({entry.name!r}, inputs=...)")

    def __getitem__(self, name: str) -> RegisteredLoss:
        self._load()
        return self._losses[name]

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(dict(self._losses))

    def __len__(self) -> int:
        self._load()
        return len(self._losses)

    def __delitem__(self, name: str) -> None:  # unregister (a test's loss, say)
        del self._losses[name]


REGISTRY = _Registry()


def register_token_loss(name: str, inputs: tuple[str, ...], config: dict | None = None,
                        optional_inputs: tuple[str, ...] = (), unread_when_zero: tuple[str, ...] = ()):
    """Decorator: register ``fn(logprobs, inputs, settings) -> [T]`` as the loss ``name``. ``inputs``: the
    per-token inputs every datum must give (checked to hold one value per target token before ``fn`` runs);
    ``config``: the keys of ``loss_fn_config`` and their defaults (None: the caller must give it; every value must
    be a finite number); ``optional_inputs``: per-token inputs a datum may add; ``unread_when_zero``: inputs that,
    all 0 at a position, make the loss and its gradient 0 there whatever the log-prob (only there may a datum's
    target differ from the next input token). Refuses a name already registered."""
    def register(fn):
        REGISTRY.add(RegisteredLoss(name, fn, tuple(inputs), dict(config or {}), tuple(optional_inputs),
                                    tuple(unread_when_zero)))
        return fn
    return register


class _View(Mapping):
    """A read-only mapping computed from the registry on every read (so it follows registrations)."""

    def __init__(self, entry: Callable[[RegisteredLoss], object], keep: Callable[[RegisteredLoss], bool]):
        self._entry, self._keep = entry, keep

    def _items(self) -> dict:
        return {name: self._entry(loss) for name, loss in REGISTRY.items() if self._keep(loss)}

    def __getitem__(self, name: str):
        return self._items()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


# Per loss: the per-token inputs it reads besides the log-probs, and its configuration with the defaults.
TOKEN_LOSSES = _View(lambda loss: (loss.inputs, dict(loss.config)), lambda loss: True)
# Per loss that has some: per-token inputs a datum may add (the tinker SDK's Datum lists them).
OPTIONAL_INPUTS = _View(lambda loss: loss.optional_inputs, lambda loss: bool(loss.optional_inputs))
# Per loss that has some: the inputs that, all 0 at a position, leave it unread (dro's penalty reads every position).
UNREAD_WHEN_ZERO = _View(lambda loss: loss.unread_when_zero, lambda loss: bool(loss.unread_when_zero))


def token_loss(name: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None = None
               ) -> torch.Tensor:
    """Per-token losses ``[T]`` of one sequence under the registered loss ``name``; their sum is the sequence's
    loss. ``logprobs`` are the model's log-probs of the target tokens (differentiable); ``inputs["logprobs"]`` are
    the sampler's. The built-in losses are documented on their functions below.

    Raises ValueError naming the loss and the input or key at fault (an unknown loss, a missing input or key, an
    unknown key, an input whose length is not the log-probs').
    """
    settings = token_loss_settings(name, config)
    loss = REGISTRY[name]
    for key in loss.inputs:
        if key not in inputs:
            raise ValueError(f"loss_fn {name!r} needs the per-token input {key!r} in every datum's loss_fn_inputs")
        if inputs[key].shape != logprobs.shape:
            raise ValueError(f"loss_fn_inputs[{key!r}] has {tuple(inputs[key].shape)} values but the datum has "
                             f"{tuple(logprobs.shape)} target tokens: give one value per target token")
    return loss.compute(logprobs, inputs, settings)


def token_loss_settings(name: str, config: dict | None) -> dict:
    """The configuration of loss ``name``: ``config`` over the defaults. Raises ValueError naming the loss and the
    key at fault (an unknown loss, an unknown key, a required key missing or not a number)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown loss_fn {name!r}; the registered losses are {sorted(REGISTRY)}")
    defaults = REGISTRY[name].config
    config = dict(config or {})
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"loss_fn_config of {name!r} has unknown key(s) {unknown}; it takes {sorted(defaults)}")
    settings = {**defaults, **config}
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"loss_fn {name!r} needs loss_fn_config[{key!r}] to be a finite number, got {value!r}")
    low, high = settings.get("clip_low_threshold"), settings.get("clip_high_threshold")
    if low is not None and not 0 <= low <= 1 <= high:  # 0.2 / 0.28 (the epsilons) would clip every ratio of 1
        raise ValueError(f"loss_fn {name!r} clips the probability ratio to [clip_low_threshold, clip_high_threshold] "
                         f"= [{low}, {high}]; these are ratios with 0 <= low <= 1 <= high (1 - eps and 1 + eps, "
                         "e.g. 0.8 and 1.2), not the epsilons themselves")
    if settings.get("beta") is not None and settings["beta"] < 0:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_config['beta'] >= 0 (the weight of its quadratic penalty), "
                         f"got {settings['beta']}")
    return settings


def clipped_ratio_loss(ratio: torch.Tensor, advantages: torch.Tensor, low, high) -> torch.Tensor:
    """PPO's clipped surrogate on ratio bounds: ``-min(ratio * A, clip(ratio, low, high) * A)`` (``low`` and
    ``high`` numbers or tensors broadcasting against ``ratio``; the epsilon form passes ``1 - eps`` and
    ``1 + eps``)."""
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


# ---- the built-in losses -----------------------------------------------------------------------------------------

_CLIPS = ("clip_low_threshold", "clip_high_threshold")  # per-token inputs of these names replace loss_fn_config's


def _bounds(ratio: torch.Tensor, inputs: dict, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio's clip bounds: a datum's per-token thresholds where given, else the configuration's."""
    low, high = (torch.as_tensor(inputs.get(key, settings.get(key)), dtype=ratio.dtype, device=ratio.device)
                 for key in _CLIPS)
    return low, high


@register_token_loss("cross_entropy", inputs=("weights",), unread_when_zero=("weights",))
def cross_entropy(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """``-weights * logp``."""
    return -inputs["weights"] * logprobs


@register_token_loss("importance_sampling", inputs=("logprobs", "advantages"), unread_when_zero=("advantages",))
def importance_sampling(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """``-exp(logp - logp_sampler) * advantages``."""
    return -torch.exp(logprobs - inputs["logprobs"]) * inputs["advantages"]


@register_token_loss("ppo", inputs=("logprobs", "advantages"),
                     config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, optional_inputs=_CLIPS,
                     unread_when_zero=("advantages",))
def ppo(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """``-min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A)``, ``ratio = exp(logp -
    logp_sampler)`` (thresholds are bounds on the ratio: 0.8 and 1.2 by default; per-token inputs of those names,
    where a datum gives them, replace loss_fn_config's, for ``cispo`` and ``gspo`` too)."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return clipped_ratio_loss(ratio, inputs["advantages"], *_bounds(ratio, inputs, settings))


@register_token_loss("cispo", inputs=("logprobs", "advantages"),
                     config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, optional_inputs=_CLIPS,
                     unread_when_zero=("advantages",))
def cispo(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """``-sg(clip(ratio, low, high)) * A * logp`` (the clipped ratio weighs the log-prob's gradient and gets none of
    its own); by default one-sided, as Tinker's: 0.0 and 4.0 (a lower bound would keep near-full updates on tokens
    the policy has moved away from)."""
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -torch.clamp(ratio, *_bounds(ratio, inputs, settings)).detach() * inputs["advantages"] * logprobs


@register_token_loss("dro", inputs=("logprobs", "advantages"), config={"beta": None})
def dro(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """``-(logp * A - beta / 2 * (logp - logp_sampler) ** 2)`` (``beta`` required; the penalty reads every
    position, so no input leaves one unread)."""
    return -(logprobs * inputs["advantages"] - 0.5 * settings["beta"] * (logprobs - inputs["logprobs"]) ** 2)


def sequence_log_ratio(logprobs: torch.Tensor, sampler: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
    """The mean of ``logprobs - sampler`` over the ``marked`` tokens (0 with none): a scalar for one sequence
    ``[T]``, ``[n, 1]`` for rows ``[n, T]`` (``grpo``'s ``policy_loss: gspo`` passes rows)."""
    if logprobs.dim() == 1:
        return (logprobs - sampler)[marked].sum() / marked.sum().clamp(min=1)
    diff = torch.where(marked, logprobs - sampler, 0.0)
    return diff.sum(-1, keepdim=True) / marked.sum(-1, keepdim=True).clamp(min=1)


@register_token_loss("gspo", inputs=("logprobs", "advantages", "sequence_ratio_mask"),
                     config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, optional_inputs=_CLIPS,
                     unread_when_zero=("advantages", "sequence_ratio_mask"))
def gspo(logprobs: torch.Tensor, inputs: dict, settings: dict) -> torch.Tensor:
    """GSPO-token: ``ppo``'s loss with every token's ratio worth the sequence ratio ``s = exp(mean over the tokens
    sequence_ratio_mask marks of (logp - logp_sampler))`` and carrying its own log-prob's gradient: ``ratio_t =
    sg(s) * exp(logp_t - sg(logp_t))`` (a sequence with no marked token has ``s = 1``). Rows ``[n, T]`` work too,
    each with its own ``s`` (:func:`sequence_log_ratio`)."""
    marked = inputs["sequence_ratio_mask"] != 0
    ratio = torch.exp(sequence_log_ratio(logprobs.detach(), inputs["logprobs"], marked) + logprobs - logprobs.detach())
    return clipped_ratio_loss(ratio, inputs["advantages"], *_bounds(ratio, inputs, settings))
