"""Adapters created at run time and snapshots, on one rank's model (a PEFT model in process, no servers): names
PEFT treats specially are refused by llmrl's own rule, on the client and on the server, naming the rule (plain PEFT
warns that ``a`` "may be reinitialised" and fails on ``update`` with a raw KeyError: the reference below); and
their count and bytes are capped by the config (``max_run_time_adapters``, ``run_time_adapters_mb``), one more
refused by name while the model and optimizer are left as they were."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from llmrl.engine.config.types import LLMConfig
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.model.served_state import PendingGradients, RunTimeAdapters
from llmrl.engine.model.snapshots import drop_snapshot, take_snapshot
from llmrl.engine.model.training.new_adapters import create_adapter, delete_adapter
from llmrl.engine.requests.adapters import check_name, check_new_name
from testkit import tiny_model

SPECIAL = ["a", "r", "lo", "ora_", "lora_", "lora_x", "update", "keys", "to", "train", "values"]


def served_model(**caps):
    """One rank's served LLM, as ``create_adapter`` and ``take_snapshot`` read it: a PEFT model holding the
    config's adapter ``default``, an optimizer over it, and the LLM's config with ``caps``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model("llama")),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    module = SimpleNamespace(model=model, trunk=None, named_parameters=model.named_parameters)
    return SimpleNamespace(
        llm=LLMConfig(name="main", model="tiny", **caps), model=model, module=module, device=torch.device("cpu"),
        engine=SimpleNamespace(module=module, optimizer=optimizer), adapter_steps=SimpleNamespace(optimizer=optimizer),
        adapters=["default"], run_time=RunTimeAdapters(), pending=PendingGradients(),
        active_adapter=lambda: "default", check_adapter=lambda name: None)


def test_plain_peft_mistakes_these_names_which_is_why_they_are_refused():
    from peft import LoraConfig

    served = served_model()
    with pytest.raises(KeyError, match="attribute 'update' already exists"):
        served.model.add_adapter("update", LoraConfig(r=4, target_modules="all-linear"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served.model.add_adapter("a", LoraConfig(r=4, target_modules="all-linear"))
    assert any("reinitialization of the adapter weights" in str(w.message) for w in caught)


@pytest.mark.parametrize("name", SPECIAL)
def test_a_name_peft_treats_specially_is_refused_by_llmrls_rule_on_the_client_and_the_server(name):
    """Before: ``a``, ``r``, ``lo`` were made (with PEFT's warning); ``update``, ``keys``, ``to`` failed with
    PEFT's KeyError."""
    with pytest.raises(InvalidArgument, match=f"adapter name '{name}' is refused by llmrl's rule for adapter names"):
        check_new_name(name, "adapter name")
    assert check_name(name, "adapter name") == name  # an existing adapter's name is only looked up
    served = served_model()
    with pytest.raises(ValueError, match="refused by llmrl's rule for adapter names: it must not be"):
        create_adapter(served, name, rank=4, alpha=None, seed=0, targets=None)
    with pytest.raises(ValueError, match="refused by llmrl's rule for adapter names: .*such as 'my_"):
        take_snapshot(served, name, None)
    assert not served.run_time.created and not served.run_time.snapshots
    assert set(served.model.peft_config) == {"default"}


def test_ordinary_names_pass_the_rule():
    for name in ("default", "policy", "tinker_1", "tinker_12_s3", "ref", "x", "b", "my_lora_a", "updates"):
        assert check_new_name(name, "adapter name") == name


def test_adapters_and_snapshots_past_the_count_cap_are_refused_by_name_and_a_dropped_one_frees_its_place():
    """Before: nothing capped them (140 adapters in 45 s, each create slower than the last)."""
    served = served_model(max_run_time_adapters=3)
    create_adapter(served, "one", rank=4, alpha=None, seed=0, targets=None)
    create_adapter(served, "two", rank=4, alpha=None, seed=1, targets=None)
    take_snapshot(served, "ref", "one")
    groups = len(served.adapter_steps.optimizer.param_groups)
    with pytest.raises(ValueError, match=r"adapter 'three' is refused: LLM 'main' holds 3 adapters created at run "
                                         r"time and snapshots \(one, two, ref\), its cap \(llms.main."
                                         r"max_run_time_adapters: 3\): delete_adapter / drop_snapshot"):
        create_adapter(served, "three", rank=4, alpha=None, seed=2, targets=None)
    with pytest.raises(ValueError, match="snapshot 'ref2' is refused: LLM 'main' holds 3"):
        take_snapshot(served, "ref2", "one")
    take_snapshot(served, "ref", "two")  # taken again under its name: it keeps its place
    assert len(served.adapter_steps.optimizer.param_groups) == groups
    assert set(served.model.peft_config) == {"default", "one", "two", "ref"}
    drop_snapshot(served, "ref")
    delete_adapter(served, "two")
    create_adapter(served, "three", rank=4, alpha=None, seed=2, targets=None)
    take_snapshot(served, "ref2", "three")


def test_an_adapter_or_snapshot_past_the_bytes_cap_is_refused_and_leaves_the_model_as_it_was():
    one = served_model()
    create_adapter(one, "one", rank=4, alpha=None, seed=0, targets=None)
    size = sum(p.numel() * p.element_size() for n, p in one.model.named_parameters() if ".one." in n)
    served = served_model(run_time_adapters_mb=2.5 * size / (1 << 20))  # room for two of them
    create_adapter(served, "one", rank=4, alpha=None, seed=0, targets=None)
    take_snapshot(served, "ref", "one")
    names = [n for n, _ in served.model.named_parameters()]
    groups = len(served.adapter_steps.optimizer.param_groups)
    with pytest.raises(ValueError, match=r"adapter 'two' \(0\.\d MB\) is refused: with it, the adapters created at "
                                         r"run time and snapshots of LLM 'main' would hold .* MB, over its cap "
                                         r"\(llms.main.run_time_adapters_mb: "):
        create_adapter(served, "two", rank=4, alpha=None, seed=1, targets=None)
    with pytest.raises(ValueError, match=r"snapshot 'ref2' \(0\.\d MB\) is refused"):
        take_snapshot(served, "ref2", "one")
    assert [n for n, _ in served.model.named_parameters()] == names
    assert len(served.adapter_steps.optimizer.param_groups) == groups and "two" not in served.run_time.created
    drop_snapshot(served, "ref")
    create_adapter(served, "two", rank=4, alpha=None, seed=1, targets=None)
