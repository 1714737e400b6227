"""Arguments of the built-in plugins that would otherwise be silently ignored or fail late: whole numbers written as
floats, freeze patterns that match nothing, and LoRA adapter specs that contradict themselves or the model."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config import PluginSpec, load_config
from llmrl.engine.errors import ConfigError, PluginError
from llmrl.plugins import checks, registry
from llmrl.plugins.contracts import LLMInfo
from llmrl.plugins.freeze import FreezeInitializer
from llmrl.plugins.lora import LoraInitializer


def _llama(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    info = LLMInfo("main", "causal", model.config.hidden_size, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    return model, info


def test_whole_numbers_written_as_floats_are_refused_where_an_integer_is_declared(tiny):
    from llmrl.plugins.ppo import PPOUpdater
    from llmrl.plugins.value_head import ValueHead

    assert checks.args_problem(PPOUpdater, {"epochs": 2.0}, "ppo").startswith("epochs: 2.0 is not of type 'integer'")
    assert "write 2" in checks.args_problem(PPOUpdater, {"epochs": 2.0}, "ppo")
    assert checks.args_problem(ValueHead, {"hidden": 64.0}, "value").startswith("hidden: 64.0 is not of type")
    assert checks.args_problem(PPOUpdater, {"epochs": 2}, "ppo") is None
    with pytest.raises(PluginError, match="bad arguments: epochs: 2.0 is not of type 'integer'"):
        registry.build("updater", PluginSpec("ppo", {"epochs": 2.0}))
    with pytest.raises(ConfigError) as err:
        load_config(raw={"llms": {"main": {"model": tiny["llama"],
                                           "updater": {"plugin": "ppo", "args": {"epochs": 2.0}}}}})
    assert "epochs: 2.0" in dict(err.value.problems)["llms.main.updater.args"]


def test_a_freeze_pattern_that_matches_nothing_names_it(tiny):
    model, info = _llama(tiny)
    with pytest.raises(ValueError, match="freeze pattern 'model.layer.\\*' matches no parameter"):
        FreezeInitializer(freeze=["model.layer.*"]).initialize(model, info)
    with pytest.raises(ValueError, match="unfreeze pattern 'lm_haed.\\*' matches no parameter"):
        FreezeInitializer(unfreeze=["lm_haed.*"]).initialize(model, info)
    FreezeInitializer(freeze=["model.layers.0.*"]).initialize(model, info)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("model.layers.0.") for name in frozen)


def test_lora_refuses_layers_with_last_layers_and_shape_keys_with_path():
    with pytest.raises(ValueError, match="adapters.a: give layers or last_layers, not both"):
        LoraInitializer({"a": {"layers": [0, 1], "last_layers": 1}})
    with pytest.raises(ValueError, match="adapters.b: r, layers given with path"):
        LoraInitializer({"a": {"r": 4}, "b": {"path": "/saved/adapter", "r": 16, "layers": [0]}})
    with pytest.raises(PluginError, match="constructing it failed: ValueError: adapters.a: alpha, dropout given with"):
        registry.build("initializer", PluginSpec("lora", {"adapters": {"a": {"path": "x", "alpha": 2, "dropout": 0}}}))
    LoraInitializer({"a": {"path": "/saved/adapter"}, "b": {"layers": [0], "r": 4}})


def test_lora_layer_indices_must_exist_in_the_model(tiny):
    problem = checks.args_problem(LoraInitializer, {"adapters": {"a": {"layers": [-1]}}}, "lora")
    assert problem == "adapters.a.layers.0: -1 is less than the minimum of 0"
    model, info = _llama(tiny)
    count = model.config.num_hidden_layers
    expected = f"adapters.policy.layers: \\[{count + 3}\\] out of range; this model has {count} layers"
    with pytest.raises(ValueError, match=f"{expected}: use indices from 0 to {count - 1}"):
        LoraInitializer({"policy": {"layers": [0, count + 3]}}).initialize(model, info)
    served = LoraInitializer({"policy": {"layers": [count - 1], "r": 2}}).initialize(model, info)
    adapted = {name for name, p in served.named_parameters() if p.requires_grad}
    assert adapted and all(f".layers.{count - 1}." in name for name in adapted)


def test_an_adapter_on_some_layers_declared_after_an_all_linear_one(tiny):
    """The layers' linear names were read from the model the first adapter had wrapped (PEFT's 'base_layer',
    'default'): start-up failed with NoMatchingPeftModuleError; in the other order it worked."""
    model, info = _llama(tiny)
    count = model.config.num_hidden_layers
    served = LoraInitializer({"default": {"r": 4}, "top": {"r": 2, "last_layers": 1}}).initialize(model, info)
    top = {name for name, p in served.named_parameters() if ".top." in name}
    everywhere = {name for name, p in served.named_parameters() if ".default." in name}
    assert top and all(f".layers.{count - 1}." in name for name in top)
    assert {name.replace(".default.", ".top.") for name in everywhere if f".layers.{count - 1}." in name} == top


@pytest.mark.parametrize("spec", [{"last_layers": 1}, {"layers": [1]}])
def test_lora_layers_of_an_encoder_decoder_pick_that_block_of_both_stacks(tiny, spec):
    """T5 names its layers ``block``: the initializer found no linear module in them and refused."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny["t5"])
    info = LLMInfo("main", "seq2seq", model.config.d_model, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    top = model.config.num_layers - 1
    assert spec.get("layers", [top]) == [top] == [model.config.num_decoder_layers - 1]
    served = LoraInitializer({"policy": {"r": 2, **spec}}).initialize(model, info)
    adapted = {name for name, p in served.named_parameters() if p.requires_grad}
    assert {"encoder", "decoder"} == {stack for stack in ("encoder", "decoder") for name in adapted
                                      if f".{stack}.block.{top}." in name}
    assert all(f".block.{top}." in name for name in adapted)


def test_lora_last_layers_of_an_encoder_decoder_with_stacks_of_two_depths_is_refused(tiny):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny["t5"], num_decoder_layers=3)
    info = LLMInfo("main", "seq2seq", model.config.d_model, model.config.vocab_size, torch.float32,
                   torch.device("cpu"))
    with pytest.raises(ValueError, match="adapters.policy.last_layers: this encoder-decoder's stacks have"):
        LoraInitializer({"policy": {"r": 2, "last_layers": 1}}).initialize(model, info)


def test_lora_dropout_which_never_acts_is_refused():
    """llmrl's models run in evaluation mode: a LoRA dropout would never be applied, yet the export would record
    it. Refused at load (the schema, naming the field) and when the plugin is built (saying why)."""
    from llmrl.plugins.checks import args_problem

    problem = args_problem(LoraInitializer, {"adapters": {"default": {"r": 4, "dropout": 0.1}}}, "lora")
    assert problem and "adapters.default.dropout" in problem
    with pytest.raises(ValueError, match="adapters.default.dropout: llmrl runs its models in evaluation mode"):
        LoraInitializer({"default": {"r": 4, "dropout": 0.1}})
    assert args_problem(LoraInitializer, {"adapters": {"default": {"r": 4, "dropout": 0}}}, "lora") is None


@pytest.mark.parametrize("updater", ["ilql", "nlpo"])
def test_steered_sampling_of_a_seq2seq_model_is_refused(updater):
    """The README says steered sampling runs causal models only; ilql's ran on T5, unchecked."""
    import types

    from llmrl.plugins.ilql import ILQLUpdater
    from llmrl.plugins.nlpo import NLPOUpdater

    view = types.SimpleNamespace(kind="seq2seq", heads={})
    with pytest.raises(ValueError, match="steered sampling runs causal models|masked sampling runs causal models"):
        (ILQLUpdater() if updater == "ilql" else NLPOUpdater()).steering(view)


def test_label_smoothing_that_ipo_would_not_read_is_refused():
    from llmrl.plugins.dpo import DPOUpdater

    with pytest.raises(ValueError, match="label_smoothing: 0.2 is not read by loss 'ipo'"):
        DPOUpdater(loss="ipo", label_smoothing=0.2)
    assert DPOUpdater(loss="ipo").label_smoothing == 0 and DPOUpdater(label_smoothing=0.2).label_smoothing == 0.2
