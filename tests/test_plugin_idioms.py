"""Lamorel's idioms, refused with the form llmrl takes: plugin instances where a class is taken (refused by
``Caller(...)`` before anything starts), constructors that do not fit the contract, and head keys that would replace
an entry of ``score()``'s results."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from llmrl.engine.client.caller import Caller
from llmrl.engine.config import load_config
from llmrl.engine.errors import ConfigError, InvalidArgumentType, PluginError
from llmrl.plugins import registry

LAMOREL_PLUGINS = '''
    import torch
    from llmrl.plugins import Head, Initializer, Updater

    class MyUpdater(Updater):
        def __init__(self, lr: float = 1e-4):
            self.lr = lr

        def update(self, batch, trainer):
            return {}

    class MyHead(Head):
        def forward(self, outputs):
            return outputs.context_hidden.sum(-1)

    class MyInitializer(Initializer):
        def initialize(self, model, llm):
            return model

    class LamorelHead(Head):  # a Lamorel module function: no llm first
        def __init__(self, model_type, pre_encoded_input=False):
            super().__init__(None)

        def forward(self, outputs):
            return outputs.context_hidden.sum(-1)

    class KeywordLlmHead(Head):
        def __init__(self, *, llm, hidden=8):
            super().__init__(llm)

        def forward(self, outputs):
            return outputs.context_hidden.sum(-1)

    class HeadLikeUpdater(Updater):  # written like a head: the engine never gives an updater llm
        def __init__(self, llm, epochs=1):
            self.epochs = epochs

        def update(self, batch, trainer):
            return {}

    class PositionalInitializer(Initializer):
        def __init__(self, rank, /, alpha=1.0):
            self.rank = rank

        def initialize(self, model, llm):
            return model

    class NeedsArgsUpdater(Updater):
        def __init__(self, minibatch_size, gradient_batch_size=4):
            self.minibatch_size = minibatch_size

        def update(self, batch, trainer):
            return {}
'''


@pytest.fixture
def lamorel(tmp_path, monkeypatch):
    (tmp_path / "lamorel_style.py").write_text(textwrap.dedent(LAMOREL_PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("lamorel_style", None)
    import lamorel_style

    return lamorel_style


# ----------------------------------------------------------------------------- 1. instances where a class is taken


def test_an_updater_instance_is_refused_by_caller_with_the_accepted_form(lamorel):
    for updater in (lamorel.MyUpdater(lr=0.1), (lamorel.MyUpdater(), {"lr": 0.1})):
        with pytest.raises(PluginError) as err:
            Caller(updater=updater)  # no run: refused before anything is looked up or started
        message = str(err.value)
        assert "Caller(updater=...) got an instance of MyUpdater" in message
        assert 'updater=MyUpdater or updater=(MyUpdater, {"arg": 1})' in message


def test_head_and_initializer_instances_and_functions_are_refused_by_caller(lamorel):
    with pytest.raises(PluginError, match=r"Caller\(heads=\{'value': \.\.\.\}\) got an instance of MyHead") as err:
        Caller(heads={"value": lamorel.MyHead(None)})
    assert 'heads={"value": MyHead} or heads={"value": (MyHead, {"hidden": 128})}' in str(err.value)
    with pytest.raises(PluginError, match=r"item 0 got an instance of MyInitializer.*initializers=\[MyInitializer\]"):
        Caller(initializers=[lamorel.MyInitializer()])
    with pytest.raises(PluginError, match=r"got the function 'value_fn'.*heads=\{\"v\": MyHead\}"):
        def value_fn(outputs):
            return outputs
        Caller(heads={"v": value_fn})


def test_lamorels_caller_call_is_answered_with_llmrls_form(lamorel):
    with pytest.raises(InvalidArgumentType) as err:  # a TypeError, as Python's own would be
        Caller(object(),  # Lamorel's config_args.lamorel_args
               custom_module_functions={"main_llm": {"mlp_head": lamorel.MyHead(None)}},
               custom_updater={"main_llm": lamorel.MyUpdater()},
               custom_model_initializer={"main_llm": lamorel.MyInitializer()})
    message = str(err.value)
    assert "Caller() takes no positional argument (got 1)" in message
    assert ("Caller(custom_updater=...) is Lamorel's; llmrl takes the class, not an instance: updater=MyUpdater or "
            "updater=(MyUpdater, {\"arg\": 1}), with llm='main_llm'") in message
    assert ('Caller(custom_module_functions=...) is Lamorel\'s; llmrl takes the class, not an instance: '
            'heads={"mlp_head": MyHead}') in message
    assert "Caller(custom_model_initializer=...) is Lamorel's; llmrl takes the class, not an instance: " \
           "initializers=[MyInitializer]" in message
    with pytest.raises(RuntimeError, match="Caller\\(\\) runs inside an llmrl launch"):  # llmrl's own form passes
        Caller(updater=(lamorel.MyUpdater, {"lr": 0.1}), heads={"v": lamorel.MyHead},
               initializers=[lamorel.MyInitializer])


def test_lamorels_per_llm_dicts_and_non_plugins_are_refused_with_the_users_names(lamorel):
    cases = [
        (dict(updater={"main_llm": lamorel.MyUpdater()}), "Caller(updater=...) got a dict without 'plugin'",
         "updater=MyUpdater or updater=(MyUpdater, {\"arg\": 1}), with llm='main_llm'"),
        (dict(heads={"main_llm": {"mlp_head": lamorel.MyHead}}), "Caller(heads={'main_llm': ...}) got a dict",
         "heads={\"mlp_head\": MyHead} or heads={\"mlp_head\": (MyHead, {\"hidden\": 128})}, with llm='main_llm'"),
        (dict(initializers={"main_llm": lamorel.MyInitializer()}), "Caller(initializers=...) takes a list, got a dict",
         "initializers=[MyInitializer] or initializers=[(MyInitializer, {\"arg\": 1})], with llm='main_llm'"),
        (dict(updater=[lamorel.MyUpdater]), "Caller(updater=...) got a list", "pass updater=MyUpdater or"),
    ]
    for kwargs, where, form in cases:
        with pytest.raises(PluginError) as err:
            Caller(**kwargs)
        assert where in str(err.value) and form in str(err.value)
        assert "updater=list" not in str(err.value)


@pytest.mark.parametrize("field,value,at,words", [
    ("updater", "instance", "llms.main.updater", "an instance of MyUpdater: a config names its plugins and holds no "
     "Python objects (each server rank builds its own): write 'lamorel_style:MyUpdater', or {plugin: "
     "'lamorel_style:MyUpdater', args: {...}} for its constructor's arguments; or give the class from your script "
     "to Caller(...): updater=MyUpdater or"),
    ("updater", "pair", "llms.main.updater", "the class MyUpdater: a config names its plugins"),
    ("heads", "class", "llms.main.heads.v", "the class MyHead: a config names its plugins and holds no Python "
     "objects (each server rank builds its own): write 'lamorel_style:MyHead'"),
    ("initializers", "instance", "llms.main.initializers.0", "write 'lamorel_style:MyInitializer', or"),
])
def test_a_python_object_in_a_config_names_the_entry_and_how_to_write_it(lamorel, field, value, at, words):
    cls = {"updater": lamorel.MyUpdater, "heads": lamorel.MyHead, "initializers": lamorel.MyInitializer}[field]
    entry = {"instance": lambda: cls() if field != "heads" else cls(None), "class": lambda: cls,
             "pair": lambda: (cls, {"lr": 0.1})}[value]()
    llm = {"model": "gpt2", field: {"updater": entry, "heads": {"v": entry}, "initializers": [entry]}[field]}
    with pytest.raises(ConfigError) as err:
        load_config(raw={"llms": {"main": llm}}, check_environment=False, check_plugins=False)
    assert words in dict(err.value.problems)[at]


# ----------------------------------------------------------------------------- 2. constructors and the contract


@pytest.mark.parametrize("kind,cls,words", [
    ("head", "LamorelHead", "its constructor is __init__(self, model_type, pre_encoded_input=False), but the head "
                            "contract is __init__(self, llm, **args)"),
    ("head", "KeywordLlmHead", "its constructor is __init__(self, *, llm, hidden=8), but the head contract"),
    ("updater", "HeadLikeUpdater", "its constructor is __init__(self, llm, epochs=1), but the updater contract is "
                                   "__init__(self, **args)"),
    ("initializer", "PositionalInitializer",
     "its constructor is __init__(self, rank, /, alpha=1.0), but rank can only be passed by position; the "
     "initializer contract is __init__(self, **args)"),
])
def test_a_constructor_off_the_contract_is_refused_where_contracts_are_checked(lamorel, kind, cls, words):
    with pytest.raises(PluginError) as err:
        registry.resolve(kind, f"lamorel_style:{cls}")
    assert f"{kind} 'lamorel_style:{cls}' ({cls}): {words}" in str(err.value)
    with pytest.raises(PluginError, match="its constructor is .* contract is"):  # on the client, before any start
        Caller(**({"heads": {"v": getattr(lamorel, cls)}} if kind == "head" else
                  {"updater": getattr(lamorel, cls)} if kind == "updater" else
                  {"initializers": [getattr(lamorel, cls)]}))


def test_constructor_problems_are_reported_with_the_config(tiny, lamorel):
    config = {"llms": {"main": {"model": tiny["llama"], "heads": {"v": "lamorel_style:LamorelHead"},
                                "updater": "lamorel_style:NeedsArgsUpdater"}}}
    with pytest.raises(ConfigError) as err:
        load_config(raw=config)
    problems = dict(err.value.problems)
    assert "the head contract is __init__(self, llm, **args)" in problems["llms.main.heads.v"]
    assert ("missing required argument(s) ['minibatch_size'] for 'lamorel_style:NeedsArgsUpdater', whose constructor "
            "is __init__(self, minibatch_size, gradient_batch_size=4)") in problems["llms.main.updater.args"]
    config["llms"]["main"].update(heads={"v": "lamorel_style:MyHead"},
                                  updater={"plugin": "lamorel_style:NeedsArgsUpdater", "args": {"minibatch_size": 2}})
    assert load_config(raw=config).llms["main"].updater.args == {"minibatch_size": 2}


# ----------------------------------------------------------------------------- 3. head keys of score()'s results


@pytest.mark.parametrize("key", ["score", "tokens", "logprobs", "entropy"])
def test_a_head_key_that_score_results_use_is_refused(tiny, key):
    with pytest.raises(ConfigError) as err:
        load_config(raw={"llms": {"main": {"model": tiny["llama"], "heads": {key: "value", "v": "value"}}}})
    problems = dict(err.value.problems)
    assert f"head key {key!r} collides with the {key!r} entry" in problems[f"llms.main.heads.{key}"]
    assert f"rename the head, e.g. '{key}_head'" in problems[f"llms.main.heads.{key}"]
    assert "llms.main.heads.v" not in problems
    with pytest.raises(PluginError, match=f"Caller\\(heads=...\\): head key {key!r} collides"):
        Caller(heads={key: "value"})


@pytest.mark.parametrize("key,words", [("half", "'half' is the name of a torch.nn.Module attribute or method"),
                                       ("a.b", "must be a non-empty string without '.'"),
                                       (3, "head key 3 must be a non-empty string")])
def test_a_head_key_the_heads_module_dict_cannot_hold_is_refused_by_name(key, words):
    """A key such as 'half' or 'train' failed at start-up inside torch's ModuleDict with a KeyError naming neither
    the head nor the field."""
    with pytest.raises(PluginError, match=f"Caller\\(heads=...\\): .*{re.escape(words)}"):
        Caller(heads={key: "value"})
