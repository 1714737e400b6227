"""The model-family registry (engine/model/families/): its answers for every model type equal the lists the engine
kept before the registry (written out here as they were), and a newcomer's family, registered in one call, is seen
by every lookup and by the modules that read them (then unregistered). No model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.model import families
from llmrl.engine.model.families import DEFAULT, Family, StepClasses, family_of, model_types_where, register

# The lists as they stood in the modules before the registry
STEP = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
        "phi3": "Phi3"}  # decoding/llama_step.py (Phi-3 added since, with its packed projections)
WINDOW_BY_LAYER_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # decoding/eligibility.py
PLAIN_OUTPUT_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "t5")  # scoring/vocab_chunks.py
RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe", "jamba",
                   "zamba", "zamba2", "falcon_h1", "bamba", "granitemoehybrid", "qwen3_next", "nemotron_h", "plamo2",
                   "minimax"}  # attention_span.py
ALIBI_TYPES = ("mpt", "bloom")  # attention_span.py
RELATIVE_POSITION_TYPES = ("t5", "mt5", "umt5", "longt5")  # config/checks.py
NO_AUTOTP = ("gpt2", "gpt_bigcode")  # config/checks.py
NO_MODEL_LAYERS = ("gpt2", "gpt_bigcode", "t5", "mt5", "umt5", "longt5")  # reuse/trunk.py: no <model>.model.layers

ALL = {*STEP, *WINDOW_BY_LAYER_TYPES, *PLAIN_OUTPUT_MODELS, *RECURRENT_TYPES, *ALIBI_TYPES, *RELATIVE_POSITION_TYPES,
       *NO_AUTOTP, "gemma2", "phi", "falcon", "opt", "smollm3", "no-such-type"}


@pytest.mark.parametrize("model_type", sorted(ALL))
def test_the_registry_answers_what_the_old_lists_said(model_type):
    family = family_of(model_type)
    assert (family.step_classes is not None) == (model_type in STEP)
    assert family.window_by_layer_types == (model_type in WINDOW_BY_LAYER_TYPES)
    assert family.plain_output == (model_type in PLAIN_OUTPUT_MODELS)
    assert family.state_outside_attention == (model_type in RECURRENT_TYPES)
    assert family.alibi == (model_type in ALIBI_TYPES)
    assert family.relative_positions == (model_type in RELATIVE_POSITION_TYPES)
    assert family.autotp == (model_type not in NO_AUTOTP)
    assert family.trunk_layers == (None if model_type in NO_MODEL_LAYERS else "model.layers")


def test_the_lookups_list_the_old_lists_in_their_order_and_the_step_its_classes():
    assert model_types_where("plain_output") == PLAIN_OUTPUT_MODELS  # (context_logits' message lists them so)
    assert model_types_where("window_by_layer_types") == WINDOW_BY_LAYER_TYPES
    assert set(model_types_where("state_outside_attention")) == RECURRENT_TYPES
    import importlib

    step = families.step_families()
    expected = []
    for key, prefix in STEP.items():  # how llama_step.py built them from strings
        module = importlib.import_module(f"transformers.models.{key}.modeling_{key}")
        expected.append(tuple(getattr(module, prefix + s) for s in
                              ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm")))
    assert [tuple(classes) for classes in step.values()] == expected
    assert list(step) == [classes[0] for classes in expected]


def test_family_of_reads_models_configs_mappings_and_names():
    config = SimpleNamespace(model_type="qwen2")
    model = SimpleNamespace(config=config)
    peft = SimpleNamespace(get_base_model=lambda: model)
    assert family_of(config) is family_of(model) is family_of(peft) is family_of({"model_type": "qwen2"}) \
        is family_of("qwen2") is families.qwen2.QWEN2
    assert family_of(None) is family_of({}) is family_of("no-such-type") is DEFAULT


def test_a_model_type_belongs_to_one_family():
    with pytest.raises(ValueError, match="already belong to Llama"):
        register(Family(name="Another", model_types=("llama",)))


class _Newcomer(torch.nn.Module):
    """A model of the newcomer's shape: its decoder layers in ``backbone.blocks``, a plain output layer."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(model_type="newcomer", sliding_window=4, layer_types=["full_attention"] * 2,
                                      max_position_embeddings=64)
        self.backbone = torch.nn.Module()
        self.backbone.blocks = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
        self.head = torch.nn.Linear(4, 8, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_a_newcomer_registered_in_one_call_is_seen_by_every_lookup_and_reader():
    from llmrl.engine.model.attention_span import keeps_state_outside_attention, why_not_whole_context
    from llmrl.engine.model.decoding.eligibility import slides_within
    from llmrl.engine.model.reuse.trunk import decoder_layers
    from llmrl.engine.model.scoring.vocab_chunks import applies

    model = _Newcomer()
    assert family_of(model) is DEFAULT and decoder_layers(model) is None and not applies(model, False)
    assert slides_within(model.config, 8)  # a window on every layer, whatever layer_types says

    class NewcomerForCausalLM(torch.nn.Module):
        pass

    classes = StepClasses(NewcomerForCausalLM, *[type(f"Newcomer{n}", (torch.nn.Module,), {}) for n in range(5)])
    newcomer = register(Family(name="Newcomer", model_types=("newcomer", "newcomer_moe"), step_classes=lambda: classes,
                               window_by_layer_types=True, plain_output=True, trunk_layers="backbone.blocks",
                               alibi=True))
    try:
        assert family_of(model) is family_of("newcomer_moe") is newcomer and newcomer in families.families()
        assert model_types_where("plain_output")[-1] == "newcomer_moe"
        assert families.step_families()[NewcomerForCausalLM] is classes
        assert decoder_layers(model) is model.backbone.blocks
        assert applies(model, False)
        assert not slides_within(model.config, 8)  # its layers read layer_types: none slides
        assert why_not_whole_context(model.config) == "ALiBi position biases"
        assert not keeps_state_outside_attention(model.config)
    finally:
        families.unregister(newcomer)
    assert family_of(model) is DEFAULT and decoder_layers(model) is None and NewcomerForCausalLM not in \
        families.step_families()
