"""Multi-LoRA batching (engine/model/row_adapters.py): one ``generate`` call whose prompts name different LoRA
adapters runs them in shared batches, each row on its own prompt's adapter. Every row is checked against the plain
PEFT model with that adapter set (``set_adapter``): greedy and beam-search tokens equal Hugging Face's own
``generate`` there, and each token's log-prob equals a plain forward's to float32 rounding (1e-5). Covered: llmrl's
loop with the written-out step and with Hugging Face's step, Hugging Face's ``generate``, sampled rows (several per
prompt, a prompt's rows cut into runs), and prompt log-probs."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.adapter_names import one_adapter_or_rows
from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.model.row_adapters import RowAdapters
from testkit.decoding import plain_logprobs
from testkit.lora_tenants import four_adapters

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "x", "a red key", "the door is"]
ADAPTERS = ["red", "green", "teal", "blue", "green"]


@pytest.fixture(scope="module")
def adapters(reference_models):
    """The tiny Llama with four LoRA adapters of random weights (testkit/lora_tenants.py)."""
    return four_adapters(reference_models)


def alone(model, adapter: str):
    model.set_adapter(adapter)
    return model


def mixed_call(model, tok, kwargs, adapters=ADAPTERS, decoder=None, max_rows=64, stacked=True, prompts=PROMPTS):
    """One generate call of ``prompts``, each on its adapter: the LoRA layers stacked (stacked_lora), or each running
    PEFT's own mixed-batch forward."""
    from llmrl.engine.model.stacked_lora import StackedLora

    plan = plan_generate(model, tok, "causal", prompts, kwargs, 8192, max_rows, 512)
    rows = RowAdapters(adapters)
    plan = type(plan)(**{**plan.__dict__, "row_adapters": rows})
    with torch.no_grad(), rows.hooked(model, whole=stacked):
        layers = [m for m in model.modules() if hasattr(m, "lora_A")]
        assert all(isinstance(vars(m).get("forward"), StackedLora) == stacked for m in layers)
        out = generate(model, tok, "causal", plan, "cpu", seed=3, decoder=decoder)
    assert not any("forward" in vars(m) or m._forward_pre_hooks for m in layers)  # all put back
    return out


def check_logprobs(model, tok, results, adapters=ADAPTERS, prompts=PROMPTS):
    for prompt, adapter, samples in zip(prompts, adapters, results):
        for sample in samples:
            plain = plain_logprobs(alone(model, adapter), tok, prompt, sample["tokens"].tolist())
            torch.testing.assert_close(sample["logprobs"], plain, atol=1e-5, rtol=0)


# six of nine prompts on one adapter: padding every group to six would more than double the rows (stacked_lora then
# runs each adapter's rows on their own)
SKEWED = (PROMPTS + ["a blue box", "the key opens", "go to", "pick up the"],
          ["red", "green", "red", "blue", "red", "red", "teal", "red", "red"])


@pytest.mark.parametrize("path", ["llama_step", "hf step", "hf generate", "llama_step, peft's mixed forward",
                                  "hf generate, peft's mixed forward", "llama_step, skewed groups"])
def test_greedy_rows_each_equal_their_adapter_alone(adapters, path):
    model, tok = adapters
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    decoder = None if path.startswith("hf generate") else Decoder(
        GenerationSettings(merge_adapter=True, llama_step=path.startswith("llama_step")), "cpu")
    prompts, names = SKEWED if "skewed" in path else (PROMPTS, ADAPTERS)
    results = mixed_call(model, tok, kwargs, names, decoder=decoder, stacked="peft" not in path, prompts=prompts)
    for prompt, adapter, (sample,) in zip(prompts, names, results):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            theirs = alone(model, adapter).generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs,
                                                    pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        eos = (theirs == tok.eos_token_id).nonzero()
        theirs = theirs[: int(eos[0]) + 1] if len(eos) else theirs
        assert sample["tokens"].tolist() == theirs.tolist(), (prompt, adapter)
    check_logprobs(model, tok, results, names, prompts)
    if decoder is not None:
        stats = decoder.stats()
        assert stats["calls"] == {"llmrl": 1} and stats["merges"] == 0  # rows of several adapters: never merged
        assert (stats["llama_step_batches"] > 0) == path.startswith("llama_step")


@pytest.mark.parametrize("max_rows", [64, 2])
def test_sampled_rows_each_read_their_adapter(adapters, max_rows):
    """Three samples per prompt: in batches of several prompts (each prompt's rows together), and, at most two rows a
    batch, a prompt's rows cut into two runs."""
    model, tok = adapters
    decoder = Decoder(GenerationSettings(), "cpu")
    results = mixed_call(model, tok, {"max_new_tokens": 6, "do_sample": True, "num_return_sequences": 3},
                         decoder=decoder, max_rows=max_rows)
    assert [len(samples) for samples in results] == [3] * len(PROMPTS)
    check_logprobs(model, tok, results)
    assert decoder.stats()["llama_step_batches"] > 0


def test_beam_search_rows_equal_their_adapter_alone(adapters):
    model, tok = adapters
    kwargs = {"max_new_tokens": 5, "num_beams": 2, "do_sample": False}
    results = mixed_call(model, tok, kwargs)
    for prompt, adapter, (sample,) in zip(PROMPTS, ADAPTERS, results):
        plan = plan_generate(alone(model, adapter), tok, "causal", [prompt], kwargs, 8192, 64, 512)
        ((theirs,),) = generate(model, tok, "causal", plan, "cpu")
        assert sample["tokens"].tolist() == theirs["tokens"].tolist()
        torch.testing.assert_close(sample["logprobs"], theirs["logprobs"], atol=1e-5, rtol=0)


def test_prompt_logprobs_read_each_prompts_adapter(adapters):
    model, tok = adapters
    results = mixed_call(model, tok, {"max_new_tokens": 2, "do_sample": False, "prompt_logprobs": True})
    for prompt, adapter, (sample,) in zip(PROMPTS, ADAPTERS, results):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = alone(model, adapter)(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(sample["prompt_logprobs"], expected, atol=1e-5, rtol=0)


def test_a_pass_whose_rows_do_not_divide_among_the_batchs_prompts_is_refused():
    rows = RowAdapters(["a", "b", "c"])
    rows.use_batch([2, 0])
    assert rows.names_of_rows(4) == ["c", "c", "a", "a"]
    with pytest.raises(RuntimeError, match="3 rows over a batch of 2 prompts"):
        rows.names_of_rows(3)
    rows.use_batch(None)  # lockstep's throw-away batch: one row
    assert rows.names_of_rows(1) == ["a"]


def test_one_name_for_every_prompt_is_the_single_adapter_path():
    assert one_adapter_or_rows(["a", "a"]) == "a"
    assert one_adapter_or_rows(["a", "b"]) == ["a", "b"]
    assert one_adapter_or_rows("a") == "a" and one_adapter_or_rows(None) is None


def test_a_request_names_known_adapters_and_no_weight_snapshot_among_others():
    from types import SimpleNamespace

    from llmrl.engine.model.row_adapters import row_adapters_for

    def check_adapter(name):
        if name not in ("red", "green", "frozen"):
            raise ValueError(f"unknown peft_adapter {name!r}")

    served = SimpleNamespace(check_adapter=check_adapter, run_time=SimpleNamespace(weight_snapshots={"frozen": {}}))
    adapter, rows = row_adapters_for(served, ["red", "green", "red"], 3)
    assert adapter is None and rows.names == ["red", "green", "red"]
    assert row_adapters_for(served, ["green", "green"], 2) == ("green", None)  # one adapter: the single-adapter path
    assert row_adapters_for(served, "frozen", 5) == ("frozen", None)
    assert row_adapters_for(served, [], 0) == (None, None)  # a replica's empty share
    with pytest.raises(ValueError, match="unknown peft_adapter 'blue'"):
        row_adapters_for(served, ["red", "blue"], 2)
    with pytest.raises(ValueError, match="weight snapshot 'frozen' among other adapters"):
        row_adapters_for(served, ["red", "frozen"], 2)
    with pytest.raises(ValueError, match="lists 3 adapter name\\(s\\) for 2 context"):
        row_adapters_for(served, ["red", "green", "red"], 2)


@pytest.mark.parametrize("base, lora", [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32"),
                                        ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("layout", [["red", "green", "green", "red", "green", "red"],
                                    ["red", "red", "red", "red", "red", "green"]])  # (skewed: adapter by adapter)
def test_a_stacked_layer_computes_each_rows_adapter_as_peft_does_in_every_dtype(base, lora, layout):
    """One LoRA layer: each row of the stacked forward against PEFT's forward with that row's adapter active, on
    that row alone. The tolerance is a hundredth of the adapter's own contribution (rounding the base output to a
    half-precision adapter's dtype, or the scaling to it, would miss by more)."""
    from peft import LoraConfig, get_peft_model

    from llmrl.engine.model.stacked_lora import StackedLora

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(1)
    peft_model = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=5, target_modules=["proj"],
                                                  init_lora_weights=False), adapter_name="red")
    peft_model.add_adapter("green", LoraConfig(r=3, lora_alpha=4, target_modules=["proj"], init_lora_weights=False))
    layer = peft_model.base_model.model.proj
    with torch.no_grad():  # an adapter's contribution small beside the base output's, as after a few steps
        for module in layer.lora_B.values():
            module.weight.mul_(0.05)
    layer.base_layer.to(getattr(torch, base))
    for module in (*layer.lora_A.values(), *layer.lora_B.values()):
        module.to(getattr(torch, lora))
    layer.eval()
    x = torch.randn(len(layout), 3, 16).to(getattr(torch, base))
    rows = RowAdapters(layout)
    rows.use_batch(list(range(len(layout))))
    assert StackedLora.takes(layer, rows.adapters)
    with torch.no_grad():
        got = StackedLora(layer, rows)(x)
        for r, name in enumerate(layout):
            peft_model.set_adapter(name)
            want = layer(x[r:r + 1])[0]
            with peft_model.disable_adapter():
                own = (want.float() - layer(x[r:r + 1])[0].float()).abs().max()
            assert got.dtype == want.dtype
            torch.testing.assert_close(got[r].float(), want.float(), atol=float(own) / 100, rtol=0)
