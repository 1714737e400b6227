"""The Phi-3 family (``model_type`` ``phi3``: Phi-3, Phi-3.5, Phi-4-mini): Llama's layout but for its packed
projections (one ``qkv_proj`` for the queries, keys and values, one ``gate_up_proj`` for the MLP's gate and up
halves) and a rotation that may turn only part of each head (``partial_rotary_factor``); a plain output layer.
Served by the written-out decode step, whose layers read the packed projections through :func:`step_projections`.
Registers its record; it loads no model and imports transformers only when the decode step asks for the classes.

What a family newcomer to the written-out step adds, all in its own module like this one: ``step_classes`` (its
Hugging Face classes, imported when asked) and, where its layers' projections are not Llama's separate ones, a
``step_projections`` function computing them as its modeling code does, in the same order (here: one product, then
slices and ``chunk``, as ``Phi3Attention`` and ``Phi3MLP``); then it names the module in ``families/__init__.py``
and adds its model type to ``tests/test_model_families.py`` and a model of it to a test against Hugging Face's own
decoding (``tests/test_family_steps.py``).
"""

from __future__ import annotations

from llmrl.engine.model.families.registry import Family, StepClasses, register


def step_classes() -> StepClasses:
    from transformers.models.phi3 import modeling_phi3 as m

    return StepClasses(m.Phi3ForCausalLM, m.Phi3Model, m.Phi3DecoderLayer, m.Phi3Attention, m.Phi3MLP, m.Phi3RMSNorm)


def step_projections(layer, linear, activation):
    """``(qkv, mlp)`` of one ``Phi3DecoderLayer`` for the written-out step (the registry's ``step_projections``):
    the packed product split as ``Phi3Attention`` splits it, and ``down(up * act(gate))`` as ``Phi3MLP``."""
    attention, mlp = layer.self_attn, layer.mlp
    packed_qkv, gate_up, down = linear(attention.qkv_proj), linear(mlp.gate_up_proj), linear(mlp.down_proj)
    act = activation(mlp.activation_fn)
    queries = attention.config.num_attention_heads * attention.head_dim
    keys = attention.num_key_value_heads * attention.head_dim

    def qkv(x):
        packed = packed_qkv(x)
        return packed[..., :queries], packed[..., queries:queries + keys], packed[..., queries + keys:]

    def feed_forward(x):
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(up * act(gate))

    return qkv, feed_forward


PHI3 = register(Family(name="Phi-3", model_types=("phi3",), step_classes=step_classes,
                       step_projections=step_projections, plain_output=True))
