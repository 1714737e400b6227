"""The model-family registry: one :class:`Family` record per family of Hugging Face models that llmrl knows a fact
about, found by the model's ``model_type``.

Every fact the engine keeps about particular families lives in their records: which Hugging Face classes the
written-out decode step (:mod:`~llmrl.engine.model.decoding.llama_step`) computes (and how it reads packed
projections), whether the sliding window follows
``layer_types``, whether the logits are a plain output layer over the last hidden state, where the frozen trunk finds
the decoder layers, whether positions are relative, whether DeepSpeed AutoTP shards it, whether some layer keeps state
outside attention, whether it uses ALiBi. A model type no family claims gets the defaults of :class:`Family` (what the
engine assumes of a model it knows nothing particular about). The family modules of this package register their
records when the package is imported (its ``__init__`` names each once); :func:`register` and :func:`unregister`
also serve a test or a user's own family. This module loads no model and imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


class StepClasses(NamedTuple):
    """The Hugging Face classes of a family whose decode step :mod:`~llmrl.engine.model.decoding.llama_step` writes
    out: the model class and the classes of its modules (Llama's layout: ``model.layers[i].self_attn`` with
    ``q_proj``..``o_proj``, ``mlp`` with ``gate_proj``/``up_proj``/``down_proj``, RMSNorms; Qwen3's ``q_norm`` and
    ``k_norm`` where they exist; other projections where the family's ``step_projections`` reads them)."""

    causal_lm: type
    model: type
    decoder_layer: type
    attention: type
    mlp: type
    norm: type


DEFAULT_LAYERS = "model.layers"  # where the frozen trunk looks for a model type no family claims


@dataclass(frozen=True)
class Family:
    """What llmrl knows of one family of models (one or more ``model_type`` values sharing every fact)."""

    name: str  # for people: "Llama", "Qwen2-MoE"
    model_types: tuple[str, ...]
    # the written-out decode step serves it: a function importing and returning its classes (imported when asked,
    # so a patched modeling module is seen), or None
    step_classes: Callable[[], StepClasses] | None = None
    # with ``step_classes``, where a decoder layer's projections are not Llama's separate ``q_proj``/``k_proj``/
    # ``v_proj`` and ``gate_proj``/``up_proj``/``down_proj``: a function ``(layer, linear, activation) -> (qkv, mlp)``
    # computing, for the normed hidden states ``x`` (rows x hidden), ``qkv(x) -> (queries, keys, values)`` (each rows
    # x heads*head_dim) and ``mlp(x)``, from ``linear(module)`` and ``activation(module)`` (the step's calls of a
    # linear layer and of an activation); None: Llama's (Phi-3's packed ones: families/phi3.py)
    step_projections: Callable | None = None
    # its layers read ``layer_types`` (built from ``use_sliding_window`` and ``max_window_layers``) to decide which
    # slide; otherwise a configured ``sliding_window`` applies to every layer (Mistral)
    window_by_layer_types: bool = False
    # its forward returns ``output layer(last hidden state)`` as the logits, unchanged (vocab_chunks, context_logits)
    plain_output: bool = False
    # the attribute path from the (PEFT-unwrapped) model to its ``nn.ModuleList`` of decoder layers, each taking the
    # hidden states as first argument: where the frozen trunk hooks in; None: the trunk does not serve it
    trunk_layers: str | None = DEFAULT_LAYERS
    relative_positions: bool = False  # no position table: ``n_positions`` is no input limit
    autotp: bool = True  # DeepSpeed AutoTP can shard it (tensor_parallel > 1)
    state_outside_attention: bool = False  # Mamba, convolution, linear-attention or recurrent layers
    alibi: bool = False  # ALiBi position biases (built from column indices)


DEFAULT = Family(name="(no family)", model_types=())
_by_type: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` the answer for each of its model types (a type claimed by another family is an error)."""
    taken = [t for t in family.model_types if t in _by_type and _by_type[t] is not family]
    if taken:
        raise ValueError(f"model type(s) {taken} already belong to {_by_type[taken[0]].name}")
    for model_type in family.model_types:
        _by_type[model_type] = family
    return family


def unregister(family: Family) -> None:
    """Forget ``family`` (its model types get the defaults again)."""
    for model_type in family.model_types:
        if _by_type.get(model_type) is family:
            del _by_type[model_type]


def families() -> list[Family]:
    """Every registered family, in the order registered."""
    return list(dict.fromkeys(_by_type.values()))


def model_type_of(model_or_config: Any) -> str | None:
    """The ``model_type`` of a model (under PEFT wrappers), a config, a config.json mapping, or a model type itself.
    A model's or config's own type: a caller that wants the text model's passes ``config.get_text_config()``."""
    if model_or_config is None or isinstance(model_or_config, str):
        return model_or_config
    if isinstance(model_or_config, dict):
        return model_or_config.get("model_type")
    if hasattr(model_or_config, "get_base_model"):
        model_or_config = model_or_config.get_base_model()
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None)


def family_of(model_or_config: Any) -> Family:
    """The family of a model, config, config.json mapping or model type (:func:`model_type_of`); :data:`DEFAULT`
    when no family claims it."""
    return _by_type.get(model_type_of(model_or_config), DEFAULT)


def model_types_where(fact: str) -> tuple[str, ...]:
    """The model types whose family's ``fact`` (a field of :class:`Family`) is true, in the order registered."""
    return tuple(t for t, family in _by_type.items() if getattr(family, fact))


def step_families() -> dict[type, StepClasses]:
    """Each model class the written-out decode step computes -> its classes (imported now: a class swapped into a
    modeling module is seen)."""
    out = {}
    for family in families():
        if family.step_classes is not None:
            classes = family.step_classes()
            out[classes.causal_lm] = classes
    return out
