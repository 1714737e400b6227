"""Log-probs and entropies of scored tokens in the updater's passes, without a full-vocabulary tensor of the pass.

A training pass over N scored positions used to keep the float32 logits of every position for the backward pass
(N x vocabulary: 36,000 x 49,152 x 4 bytes is 7 GB) and the log-softmax made more copies; its passes without
gradients (old policy, reference) computed the logits of every position of a model call at once. Here, while an
updater's pass runs (:func:`hidden_instead_of_logits`), the model's output layer hands back its input, the last hidden
states, instead of logits; the scoring code keeps the rows it scores as it would keep logits, and
:func:`scored_logprobs_from_hidden` turns them into log-probs:

- each row's normaliser (logsumexp) and entropy are computed a chunk of rows at a time; with gradients
  (:class:`ChunkedLogprobs`) only the hidden states and each row's normaliser and entropy are kept, and the
  backward pass computes each chunk's logits again and writes their gradient out directly; a pass small enough
  (:data:`KEEP_FOR_BACKWARD`, 128 MB of logits) keeps its chunks' logits instead of computing them again;
- each target's logit is taken from its row's chunk of logits, as it was from the full logits.

The values are those of the full logits, to float32 rounding (a chunk's matrix product adds in its own order).
``score`` requests keep the logits of their model calls: their log-probs stay bit-equal to ``generate``'s. Used only
where it is exact and possible
(:func:`applies`): models whose logits are exactly the output layer applied to the last hidden state (no soft-capping
or scaling after it: the families with ``plain_output``, :mod:`~llmrl.engine.model.families`: Llama, Mistral,
Qwen2/3, Phi-3, GPT-2, T5), an output layer that is a plain ``nn.Linear``,
weights not partitioned (ZeRO-3 gathers a module's weights only inside its own calls, which would differ between
replicas), and no head asking for the logits. Elsewhere passes keep logits as before. This module makes no model
call of its own besides the output layer.
"""

from __future__ import annotations

import contextlib

import torch

from llmrl.engine.model import cpu_matmul
from llmrl.engine.model.families import family_of
from llmrl.engine.model.scoring.normalise import at_least_float32

# rows are normalised in chunks of at most this many logits: 32 MiB in float32, the largest block a server rank's
# allocator keeps for reuse (host_malloc: reuse), so a chunk's logits are not page-faulted in afresh at every chunk
# (benchmarks.trunk_update, the demo's update: 2.78 s against 2.94 s with 64 MiB chunks, one after the other)
LOGITS_PER_CHUNK = 1 << 23
# an output-layer call with gradients whose rows' logits take at most this many bytes keeps its chunks' logits for its
# backward pass (a pass making several model calls before its backward keeps this much per call) instead of computing
# them again there (the demo's update: 260 rows x 49,152, 51 MB, saves one output-layer matrix product of three per
# pass); a larger pass keeps only the hidden states and two numbers per row
KEEP_FOR_BACKWARD = 128 << 20

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
    if not family_of(getattr(config, "model_type", None)).plain_output:
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
    row's entropy; float32 (or wider). With gradients, :class:`ChunkedLogprobs` keeps only ``hidden`` and two numbers
    per row for the backward pass."""
    rows = torch.arange(len(targets), device=targets.device) if index is None else index
    weight, bias = layer.weight, layer.bias
    step = max(1, LOGITS_PER_CHUNK // weight.shape[0])
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        logp, entropies, _ = chunked_values(hidden, weight, bias, rows, targets, entropy, step)
        return logp, entropies
    logp, entropies = ChunkedLogprobs.apply(hidden, weight, bias, rows, targets, entropy, step)
    return logp, entropies if entropy else None


def chunked_values(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor,
                   targets: torch.Tensor, entropy: bool, step: int, kept: list | None = None):
    """Each target's log-prob, each row's entropy (with ``entropy``, else None) and each row's normaliser, computed
    ``step`` rows of logits at a time; ``kept``, when given, receives each chunk's logits."""
    order, bounds = _targets_by_chunk(rows, hidden.shape[0], step)
    norms, entropies, chosen, taken = [], [], [], []
    for k, first in enumerate(range(0, hidden.shape[0], step)):
        mine = order[bounds[k]:bounds[k + 1]]
        logits = at_least_float32(cpu_matmul.linear(hidden[first:first + step], weight, bias))
        norm, entropies_here = normaliser_and_entropy(logits, entropy)
        if kept is not None:
            kept.append(logits)
        norms.append(norm)
        if entropy:
            entropies.append(entropies_here)
        chosen.append(logits[rows[mine] - first, targets[mine]])
        taken.append(mine)
    if not norms:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, empty if entropy else None, empty
    norm = torch.cat(norms)
    where = torch.empty_like(order)
    where[torch.cat(taken)] = torch.arange(len(order), device=order.device)
    target_logits = torch.cat(chosen)[where]
    return target_logits - norm[rows], torch.cat(entropies) if entropy else None, norm


def normaliser_and_entropy(logits: torch.Tensor, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's logsumexp and, with ``entropy``, the entropy of its softmax, written ``H = logsumexp - sum(p *
    logits)``: a maximum, one exponential, a sum and a row-wise dot product over the chunk, where
    :func:`~llmrl.engine.model.scoring.normalise.entropy_of` makes about ten passes and five chunk-sized copies
    (measured at 256 x 49,152 on a CPU: 33 ms against 98 ms, the matrix product of the logits 58 ms; the same float32
    error against float64, 5e-6). For an output layer's logits (finite), outside autograd."""
    if not entropy:
        return torch.logsumexp(logits, dim=-1), None
    top = logits.amax(dim=-1, keepdim=True)
    scaled = torch.sub(logits, top).exp_()
    total = scaled.sum(-1)
    norm = top.squeeze(-1) + total.log()
    return norm, norm - torch.linalg.vecdot(scaled, logits) / total


def _targets_by_chunk(rows: torch.Tensor, n_rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets sorted by row, and where each chunk of ``step`` rows starts and ends in that order."""
    order = torch.argsort(rows)
    bounds = torch.searchsorted(rows[order], torch.arange(0, n_rows + step, step, device=rows.device))
    return order, bounds


class ChunkedLogprobs(torch.autograd.Function):
    """Log-probs of targets and entropies of rows from hidden states and the output layer, a chunk of rows at a time.

    Forward: :func:`chunked_values`. Backward: each chunk's logits (kept from the forward pass when all of them fit in
    :data:`KEEP_FOR_BACKWARD`, else computed again) give the gradient of the logits, written out directly, ``-p * (g_row
    + g_entropy * (log p + H))`` plus each target's own gradient at its token (``p`` the softmax from the kept
    normaliser, ``g_row`` the sum of the row's targets' gradients), then sent through the output layer. This is the
    gradient autograd derives through ``logsumexp``, the gather and :func:`entropy_of`, without keeping or recomputing
    their intermediates; the entropy term is skipped when no loss reads the entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, entropy: bool, step: int):
        width = torch.promote_types(hidden.dtype, torch.float32).itemsize
        ctx.kept = [] if hidden.shape[0] * weight.shape[0] * width <= KEEP_FOR_BACKWARD else None
        logp, entropies, norm = chunked_values(hidden, weight, bias, rows, targets, entropy, step, ctx.kept)
        if entropies is None:
            entropies = norm.new_zeros(0)
            ctx.mark_non_differentiable(entropies)
        ctx.save_for_backward(hidden, weight, bias, rows, targets, norm, entropies)
        ctx.step = step
        ctx.set_materialize_grads(False)
        return logp, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradient is written out directly: no graph of its own
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, rows, targets, norm, entropies = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        step, kept = ctx.step, ctx.kept
        ctx.kept = None  # written over below: a second backward pass (retain_graph) computes the logits again
        order, bounds = _targets_by_chunk(rows, hidden.shape[0], step)
        chunks = range(0, hidden.shape[0], step) if grad_logp is not None or grad_entropy is not None else ()
        for k, first in enumerate(chunks):
            chunk = hidden[first:first + step]
            if kept is not None:
                logits, kept[k] = kept[k], None  # freed as it is used
            else:
                logits = at_least_float32(cpu_matmul.linear(chunk, weight, bias))
            weight_per_row = logits.new_zeros(logits.shape[0])
            mine = order[bounds[k]:bounds[k + 1]]
            local, picked = rows[mine] - first, targets[mine]
            if grad_logp is not None:
                weight_per_row.index_add_(0, local, grad_logp[mine].to(logits.dtype))
            logq = logits.sub_(norm[first:first + step, None])  # in place: the chunk's logits are not needed after
            if grad_entropy is not None:
                p = logq.exp()
                g_entropy = grad_entropy[first:first + step].to(logits.dtype)[:, None]
                # -p ((log p + H) g_H + g_row), in place on log p
                grad = logq.add_(entropies[first:first + step, None]).mul_(g_entropy).add_(weight_per_row[:, None])
                grad.mul_(p).neg_()
            else:
                grad = logq.exp_().mul_(weight_per_row[:, None]).neg_()  # -p g_row
            if grad_logp is not None:
                grad.index_put_((local, picked), grad_logp[mine].to(logits.dtype), accumulate=True)
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[first:first + step] = cpu_matmul.times_weight(grad, weight)
            if need_weight:
                grad_weight.addmm_(grad.T, chunk.to(weight.dtype))
            if need_bias:
                grad_bias.add_(grad.sum(0))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
