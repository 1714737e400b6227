"""The decode step of Llama-shaped models written out as plain tensor code (``generation.llama_step``).

On a CPU a decode step of a small model is its weight matmuls plus, around them, Hugging Face's module machinery:
per layer about a hundred small operations and Python calls (keyword plumbing, mask and cache objects, the growing
key/value cache copied by ``torch.cat`` at every step). For decoder layers whose computation is Llama's
(the families whose record names their classes, :func:`~llmrl.engine.model.families.step_families`: Llama,
Mistral, Qwen2, Qwen3 and Phi-3), :class:`LlamaStep` runs each decode step
(one token per row) as the same operations in the same order, over the model's own modules' weights:
  - RMSNorm in float32 (``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``), the model's own rotary module, the
    rotation ``x cos + rotate_half(x) sin`` (after Qwen3's norm of each query and key head; of each head's first
    part only where the rotation is partial), the MLP ``down(act(gate(x)) * up(x))``, the residual adds; a family
    whose projections are packed (Phi-3's ``qkv_proj`` and ``gate_up_proj``) says in its record how to compute them
    as its modeling code does (``Family.step_projections``);
  - attention by ``scaled_dot_product_attention`` with the query heads of each key/value head grouped as Hugging
    Face groups them for one query token, under the padding mask, with the layer's own scale;
  - the key/value cache preallocated for the batch's whole length and written in place, one column a step;
  - each linear layer called without ``nn.Module``'s call machinery where that computes the same thing: a plain
    ``nn.Linear`` (its packed ``forward`` of :mod:`.packed_linears` where there is one), and a PEFT LoRA layer whose
    adapter is off (the merged adapter of :mod:`.merged_lora`) through its base layer; anything else (an unmerged
    adapter) is called as a module.
The results are those of Hugging Face's step within float32 rounding (the tests hold tokens equal and log-probs to
1e-5). :meth:`LlamaStep.why_not` names what rules a model out: another model or module class (a subclass
included), training mode (the model's, or a layer's with attention dropout), another attention implementation than
``sdpa``, a sliding window shorter than the batch, code patched into the family's classes or modeling module (a
``forward``, the rotation helpers, the registered ``sdpa`` attention function), a ``forward`` replaced on a module
(but a linear layer's, called as it is, and activation checkpointing's, the layer's own without gradients), or a
forward hook on any module (ZeRO-3's, a user's; not the output-capturing hooks Hugging Face leaves on the layers
once a forward returned hidden states, which record only inside its own forward);
the frozen trunk's own hook
(:mod:`~llmrl.engine.model.reuse.trunk`) is replaced by handing back the states entering its depth. The prefill
runs through Hugging Face's forward. This module computes steps; it does not choose tokens or plan batches
(:mod:`.loop`).
"""

from __future__ import annotations

import torch

from llmrl.engine.model.decoding.eligibility import slides_within
from llmrl.engine.model.families import family_of, step_families
from llmrl.engine.model.row_adapters import RowAdapters


def _head_norms(attention) -> list:
    """Qwen3's norms of each query and key head (none in the other families)."""
    return [norm for name in ("q_norm", "k_norm") if (norm := getattr(attention, name, None)) is not None]


def _foreign(function) -> bool:
    """Whether ``function``, or a function it wraps (``__wrapped__``: a wrapper copies the wrapped one's name and
    module), was written outside transformers: read from the module whose globals each one runs in."""
    while function is not None:
        if not str(getattr(function, "__globals__", {}).get("__name__", "")).startswith("transformers."):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _patched_code(model_class, classes: tuple) -> str | None:
    """What of the code Hugging Face's step runs is not transformers' own (a class's ``forward``, the rotation
    helpers or the ``sdpa`` attention function replaced, as attention-patching libraries do), or None."""
    import sys

    module = sys.modules[model_class.__module__]
    for cls in (model_class, *classes):
        if cls.__module__ != module.__name__:  # the class itself replaced in the modeling module
            return f"{cls.__name__} (a class of {cls.__module__})"
        if _foreign(cls.forward):
            return f"{cls.__name__}.forward"
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        helper = getattr(module, name, None)
        if helper is not None and _foreign(helper):
            return f"{module.__name__}.{name}"
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward:
        return "the 'sdpa' attention function"
    return None


# Hugging Face installs these on decoder layers the first time a forward returns hidden states or attentions: they
# record only inside such a forward (a context variable names what to record), never in this module's steps
_INERT_HOOKS = "transformers.utils.output_capturing"


def _hooked(module, allowed=()) -> bool:
    """Whether ``module`` has a forward hook that skipping its ``__call__`` would skip (other than ``allowed``
    objects' bound methods, Hugging Face's inert output-capturing hooks, and the per-row adapter names of
    :class:`~llmrl.engine.model.row_adapters.RowAdapters`, whose LoRA layers the step calls as modules)."""
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return any(getattr(hook, "__self__", None) not in allowed and getattr(hook, "__module__", None) != _INERT_HOOKS
               and not isinstance(getattr(hook, "__self__", None), RowAdapters) for hook in hooks)


def _linear(module, float32: bool):
    """A callable computing ``module(x)``, skipping ``nn.Module.__call__`` where that computes the same thing.
    ``float32``: every input is float32 with the batch's row count (a packed layer's product is then called
    directly)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        LoraLayer = ()
    if isinstance(module, LoraLayer) and module.disable_adapters and not module.merged and not _hooked(module):
        module = module.get_base_layer()  # PEFT's forward with the adapter off: the base layer alone
    if isinstance(module, torch.nn.Linear) and not _hooked(module) and (
            "forward" in vars(module) or type(module).forward is torch.nn.Linear.forward):
        packed = vars(module).get("forward")
        if packed is not None and float32 and hasattr(packed, "product"):
            return packed.product()  # the packed product (:mod:`.packed_linears`)
        if packed is not None:
            return packed
        weight, bias = module.weight, module.bias
        return lambda x: torch.nn.functional.linear(x, weight, bias)
    return module


def _norm(module):
    weight, eps = module.weight, module.variance_epsilon
    if weight.dtype == torch.float32:  # torch's fused norm: one call (equal to the steps in float32 in the tests)
        shape = tuple(weight.shape)
        return lambda x: torch.nn.functional.rms_norm(x, shape, weight, eps) if x.dtype == torch.float32 \
            else _norm_steps(x, weight, eps)
    return lambda x: _norm_steps(x, weight, eps)


def _norm_steps(x, weight, eps):
    """Hugging Face's RMSNorm."""
    dtype = x.dtype
    x = x.to(torch.float32)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rotated(x, cos, sin):
    turned = cos.shape[-1]
    if turned < x.shape[-1]:  # a partial rotation (``partial_rotary_factor``): the rest of each head passes as is
        return torch.cat((_rotated(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _activation(act):
    """A callable computing ``act(x)``: an unhooked module's own ``forward``."""
    return act.forward if isinstance(act, torch.nn.Module) and not _hooked(act) else act


def _separate_projections(layer, linear, activation):
    """Llama's ``(qkv, mlp)``: separate query, key and value projections, and ``down(act(gate(x)) * up(x))`` (a
    family with other projections says how it reads them: ``Family.step_projections``)."""
    attention, mlp = layer.self_attn, layer.mlp
    q, k, v = (linear(getattr(attention, name)) for name in ("q_proj", "k_proj", "v_proj"))
    gate, up, down = (linear(getattr(mlp, name)) for name in ("gate_proj", "up_proj", "down_proj"))
    act = activation(mlp.act_fn)
    return (lambda x: (q(x), k(x), v(x))), (lambda x: down(act(gate(x)) * up(x)))


class _Layer:
    """One decoder layer's callables and shapes, resolved once per batch."""

    def __init__(self, layer, float32: bool, projections):
        attention = layer.self_attn
        self.norm_in, self.norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        self.qkv, self.mlp = projections(layer, lambda module: _linear(module, float32), _activation)
        self.o = _linear(attention.o_proj, float32)
        self.head_dim, self.groups, self.scale = attention.head_dim, attention.num_key_value_groups, attention.scaling
        self.q_norm, self.k_norm = (_norm(getattr(attention, name)) if hasattr(attention, name) else None
                                    for name in ("q_norm", "k_norm"))  # per head, before the rotation (Qwen3)


class LlamaStep:
    """The decode steps of one batch (see the module's docstring): its key/value cache and resolved layers."""

    @staticmethod
    def why_not(model, length: int, trunk=None) -> str | None:
        """None when this module computes ``model``'s decode steps for a batch of ``length`` positions; else why
        not. ``trunk``: the frozen trunk whose hook on its depth's layer is expected."""
        served = step_families()
        found = served.get(type(model))
        if found is None:
            return (f"a model of class {type(model).__name__} (this step computes "
                    f"{', '.join(cls.__name__ for cls in served)})")
        classes = found[1:]  # the base model, decoder layer, attention, MLP and norm classes
        base, decoder_layer, attention, mlp, norm = classes
        inner = model.model
        if type(inner) is not base or type(inner.norm) is not norm or any(
                type(layer) is not decoder_layer or type(layer.self_attn) is not attention or type(layer.mlp) is not mlp
                or type(layer.input_layernorm) is not norm or type(layer.post_attention_layernorm) is not norm
                or any(type(head_norm) is not norm for head_norm in _head_norms(layer.self_attn))
                for layer in inner.layers):
            return f"modules of {type(model).__name__} replaced by other classes"
        patched = _patched_code(type(model), classes)
        if patched is not None:
            return f"{patched} patched (Hugging Face's step would run other code than transformers' own)"
        if model.training:
            return "a model in training mode (attention dropout)"
        config = model.config
        if getattr(config, "attention_dropout", 0.0) and any(layer.self_attn.training for layer in inner.layers):
            return "attention dropout in a layer left in training mode"
        if getattr(config, "_attn_implementation", None) != "sdpa":
            return f"attention implementation {getattr(config, '_attn_implementation', None)!r} (this step: sdpa)"
        if slides_within(config, length):
            return "a sliding attention window shorter than the batch"
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return "global module hooks"
        allowed = (trunk,) if trunk is not None else ()
        for module in model.modules():
            if _hooked(module, allowed):
                return f"a forward hook on {type(module).__name__}"
            replaced = vars(module).get("forward")  # (a linear layer's: called as it is, see _linear)
            if replaced is not None and not isinstance(module, torch.nn.Linear) \
                    and not getattr(replaced, "same_without_grad", False):
                return f"a forward replaced on {type(module).__name__}"
        return None

    def __init__(self, model, prefill, source: torch.Tensor, length: int, capture_at: int | None = None):
        """``prefill``: the Hugging Face cache of the batch's prompts (one row per prompt); ``source``: for each
        decoded row, its prompt's row; ``length``: the positions the batch holds; ``capture_at``: the layer whose
        input states :meth:`step` hands back (the frozen trunk's depth), or None."""
        inner = model.model
        float32 = inner.embed_tokens.weight.dtype == torch.float32
        projections = family_of(model).step_projections or _separate_projections
        self.layers = [_Layer(layer, float32, projections) for layer in inner.layers[: model.config.num_hidden_layers]]
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, _norm(inner.norm)
        self.head = _linear(model.get_output_embeddings(), float32)
        self.capture_at = capture_at
        self.keys, self.values = [], []
        for index in range(len(self.layers)):
            done_keys, done_values = prefill.layers[index].keys, prefill.layers[index].values
            rows, heads, filled, dim = len(source), done_keys.shape[1], done_keys.shape[2], done_keys.shape[3]
            keys = done_keys.new_empty((rows, heads, length, dim))
            values = done_values.new_empty((rows, heads, length, dim))
            keys[:, :, :filled] = done_keys[source]
            values[:, :, :filled] = done_values[source]
            self.keys.append(keys)
            self.values.append(values)
        self.filled = filled

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attention: torch.Tensor):
        """Feed one token per row (``tokens``: rows; ``positions``: rows x 1; ``attention``: rows x length, true
        where a row attends, this token's column included): float32 logits (rows x vocabulary), and the states
        entering layer ``capture_at`` (rows x 1 x hidden, or None)."""
        rows, column = tokens.shape[0], self.filled
        hidden = self.embed(tokens)
        cos, sin = self.rotary(hidden[:, None], positions)  # rows x 1 x head_dim: broadcast over the heads
        mask = attention[:, None, None, :column + 1].bool()
        captured = None
        for index, layer in enumerate(self.layers):
            if index == self.capture_at:
                captured = hidden[:, None]
            x = layer.norm_in(hidden)
            dim = layer.head_dim
            q, k, v = layer.qkv(x)
            q, k = q.view(rows, -1, dim), k.view(rows, -1, dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
            keys, values = self.keys[index], self.values[index]
            keys[:, :, column] = k
            values[:, :, column] = v.view(rows, -1, dim)
            heads = keys.shape[1]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.view(rows, heads, layer.groups, dim), keys[:, :, :column + 1], values[:, :, :column + 1],
                attn_mask=mask, scale=layer.scale)
            hidden = hidden + layer.o(out.reshape(rows, -1))
            x = layer.norm_post(hidden)
            hidden = hidden + layer.mlp(x)
        self.filled += 1
        return self.head(self.norm(hidden)).float(), captured

    def hf_cache(self, config):
        """The cache as Hugging Face's ``DynamicCache`` holding every column filled (for the cache kept across
        calls)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        for index, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys[:, :, :self.filled].contiguous(), values[:, :, :self.filled].contiguous(), index)
        return cache
