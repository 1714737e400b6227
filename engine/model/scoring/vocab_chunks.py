"""Log-probs and entropies of scored tokens in the updater's passes, without a full-vocabulary tensor of the pass.

A training pass over N scored positions used to keep the float32 logits of every position for the backward pass
(N x vocabulary: 36,000 x 49,152 x 4 bytes is 7 GB) and the log-softmax made more copies; its passes without
gradients (old policy, reference) computed the logits of every position of a model call at once. Here, while an
updater's pass runs (:func:`hidden_instead_of_logits`), the model's output layer hands back its input, the last hidden
states, instead of logits; the scoring code keeps the rows it scores as it would keep logits, and
:func:`scored_logprobs_from_hidden` turns them into log-probs:

- each row's normaliser (logsumexp) and entropy are computed a chunk of rows at a time, each chunk under
  ``torch.utils.checkpoint`` when gradients are on: only the chunk's hidden states are kept, its logits are computed
  again in the backward pass, one chunk at a time;
- each target's logit is taken from its row's chunk of logits, as it was from the full logits.

The values are those of the full logits, to float32 rounding (a chunk's matrix product adds in its own order).
``score`` requests keep the logits of their model calls: their log-probs stay bit-equal to ``generate``'s. Used only
where it is exact and possible
(:func:`applies`): models whose logits are exactly the output layer applied to the last hidden state (no soft-capping
or scaling after it: Llama, Mistral, Qwen2/3, Phi-3, GPT-2, T5), an output layer that is a plain ``nn.Linear``,
weights not partitioned (ZeRO-3 gathers a module's weights only inside its own calls, which would differ between
replicas), and no head asking for the logits. Elsewhere passes keep logits as before. This module makes no model
call of its own besides the output layer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from llmrl.engine.model.scoring.normalise import at_least_float32, entropy_of

# Model types whose forward returns lm_head(last hidden state) as the logits, unchanged.
PLAIN_OUTPUT_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "t5")
LOGITS_PER_CHUNK = 1 << 24  # rows are normalised in chunks of at most this many logits (64 MB in float32)

_active: list[torch.nn.Module] = []  # the output layer while a pass hands back hidden states (at most one)


def output_layer(model) -> torch.nn.Module | None:
    """The model's output (vocabulary) layer, under PEFT wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    getter = getattr(base, "get_output_embeddings", None)
    return getter() if getter is not None else None


def applies(model, token_logits: bool) -> bool:
    """Whether passes with gradients of ``model`` can use hidden states instead of logits (see the module)."""
    if token_logits:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "model_type", None) not in PLAIN_OUTPUT_MODELS:
        return False
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return False
    layer = output_layer(model)
    return type(layer) is torch.nn.Linear and not hasattr(layer.weight, "ds_id")


@contextlib.contextmanager
def hidden_instead_of_logits(model):
    """While active, the model's output layer returns its input (the last hidden states), and
    :func:`active_output_layer` names it."""
    layer = output_layer(model)
    layer.forward = _identity
    _active.append(layer)
    try:
        yield
    finally:
        _active.pop()
        del layer.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def active_output_layer() -> torch.nn.Module | None:
    """The output layer whose hidden states stand for logits in the pass running now, or None."""
    return _active[-1] if _active else None


def scored_logprobs_from_hidden(layer: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, entropy: bool,
                                index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What :func:`~llmrl.engine.model.scoring.results.scored_logprobs` returns for the logits ``layer(hidden)``: the
    log-prob of each target (``targets[i]`` predicted by row ``index[i]``, or row ``i``) and, with ``entropy``, every
    row's entropy; float32 (or wider)."""
    rows = torch.arange(len(targets), device=targets.device) if index is None else index
    weight, bias = layer.weight, layer.bias
    step = max(1, LOGITS_PER_CHUNK // weight.shape[0])

    def normalise(chunk: torch.Tensor, local_rows: torch.Tensor, chunk_targets: torch.Tensor):
        logits = at_least_float32(torch.nn.functional.linear(chunk, weight, bias))
        norm = torch.logsumexp(logits, dim=-1)
        stats = torch.stack([norm, entropy_of(logits, norm)]) if entropy else norm[None]
        return stats, logits[local_rows, chunk_targets]

    order = torch.argsort(rows)
    bounds = torch.searchsorted(rows[order], torch.arange(0, hidden.shape[0] + step, step, device=rows.device))
    stats, chosen, taken = [], [], []
    for k, first in enumerate(range(0, hidden.shape[0], step)):
        mine = order[bounds[k]:bounds[k + 1]]
        inputs = (hidden[first:first + step], rows[mine] - first, targets[mine])
        part, picked = checkpoint(normalise, *inputs, use_reentrant=False) if torch.is_grad_enabled() else \
            normalise(*inputs)
        stats.append(part)
        chosen.append(picked)
        taken.append(mine)
    if not stats:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty if entropy else None
    stats = torch.cat(stats, dim=1)
    where = torch.empty_like(order)
    where[torch.cat(taken)] = torch.arange(len(order), device=order.device)
    target_logits = torch.cat(chosen)[where]
    return target_logits - stats[0][rows], stats[1] if entropy else None
