"""Config checks across keys and against the machine that name the field at validation time: training.deepspeed keys
llmrl owns, LoRA under tensor parallelism at every ZeRO stage, max_length against the model's position limit, GPU ids
and devices: auto against the GPUs there are, options the chosen type does not read, and overrides that create a
misspelt LLM."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config import load_config
from llmrl.engine.errors import ConfigError


def _problems(raw, **kwargs) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(raw=raw, **kwargs)
    return dict(err.value.problems)


@pytest.fixture
def base(tiny):
    return {"llms": {"main": {"model": tiny["llama"]}}}


# ----------------------------------------------------------------------------- 1. training.deepspeed


@pytest.mark.parametrize("extra,path,owner", [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "llms.main.training.zero_stage"),
    ({"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu", "llms.main.training.micro_batch_size"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps",
     "llms.main.training.gradient_accumulation_steps"),
    ({"gradient_clipping": 5}, "gradient_clipping", "llms.main.training.gradient_clipping"),
    ({"bf16": {"enabled": True}}, "bf16.enabled", "llms.main.dtype"),
    ({"bfloat16": {"enabled": True}}, "bfloat16.enabled", "llms.main.dtype"),
    ({"fp16": {"enabled": True}}, "fp16.enabled", "llms.main.dtype"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size", "llms.main.tensor_parallel"),
    # a review ran them: the optimizer section had no effect; the scheduler replaced lr 1e-3 by 0.0 (WarmupLR)
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}}, "optimizer", "llms.main.training.optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler", "llms.main.training.lr_schedule"),
])
def test_deepspeed_keys_llmrl_owns_are_refused_naming_the_llmrl_key(base, extra, path, owner):
    base["llms"]["main"]["training"] = {"deepspeed": extra}
    problems = _problems(base, check_environment=False, check_plugins=False)
    message = problems[f"llms.main.training.deepspeed.{path}"]
    assert f"set {owner} instead" in message


def test_the_reviewers_deepspeed_example_reports_every_key(base):
    base["llms"]["main"]["training"] = {"deepspeed": {"zero_optimization": {"stage": 3}, "gradient_clipping": 5,
                                                      "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}}}
    problems = _problems(base, check_environment=False, check_plugins=False)
    assert sorted(problems) == [f"llms.main.training.deepspeed.{k}" for k in (
        "bf16.enabled", "gradient_clipping", "train_micro_batch_size_per_gpu", "zero_optimization.stage")]


def test_other_deepspeed_keys_stay_allowed_and_sections_must_be_mappings(base):
    base["llms"]["main"]["training"] = {"zero_stage": 2, "deepspeed": {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}, "stage3_max_live_parameters": 10**9},
        "fp16": {"loss_scale": 0}, "tensor_parallel": {"tp_overlap_comm": False}, "communication_data_type": "fp32"}}
    config = load_config(raw=base, check_environment=False, check_plugins=False)
    assert config.llms["main"].training.deepspeed["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    base["llms"]["main"]["training"]["deepspeed"] = {"zero_optimization": 3}
    message = _problems(base, check_environment=False, check_plugins=False)[
        "llms.main.training.deepspeed.zero_optimization"]
    assert "must be a mapping" in message and "llms.main.training.zero_stage" in message


# ----------------------------------------------------------------------------- 2. LoRA and tensor parallelism


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_lora_with_tensor_parallel_is_accepted_at_every_zero_stage(base, zero):
    """The adapters stay whole on every tensor-parallel rank, which applies its part (tp_lora); under ZeRO-3 they are
    partitioned over the replicas like any weight and gathered for each pass (test_run_time_adapters_live.py)."""
    base["llms"]["main"].update({"tensor_parallel": 2, "initializers": ["llmrl.plugins.lora:LoraInitializer"],
                                 "training": {"zero_stage": zero}})
    llm = load_config(raw=base, check_environment=False).llms["main"]
    assert (llm.tensor_parallel, llm.training.zero_stage) == (2, zero)


@pytest.mark.parametrize("kernels", [False, True])
def test_float16_on_cpu_follows_deepspeeds_test_of_the_cpus_float16_kernels(base, monkeypatch, kernels):
    """DeepSpeed's CPU accelerator computes float16 where oneDNN has float16 kernels (AVX-512 FP16, AMX) and refuses
    it elsewhere: the config says so at validation, naming dtype, instead of DeepSpeed at start-up."""
    from llmrl.engine.config import checks

    monkeypatch.setattr(checks, "cpu_float16", lambda: kernels)
    base["llms"]["main"]["dtype"] = "float16"
    if kernels:
        assert load_config(raw=base, check_plugins=False).llms["main"].dtype == "float16"
    else:
        assert "needs oneDNN's float16 kernels" in _problems(base, check_plugins=False)["llms.main.dtype"]


# ----------------------------------------------------------------------------- 3. max_length


@pytest.mark.parametrize("kind,key", [("llama", "max_position_embeddings"), ("gpt2", "n_positions")])
def test_max_length_above_the_models_position_limit(tiny, kind, key):
    raw = {"llms": {"main": {"model": tiny[kind], "max_length": 100_000}}}
    message = _problems(raw, check_plugins=False)["llms.main.max_length"]
    assert f"({key}: 512 in its config)" in message and "at most 512" in message
    raw["llms"]["main"]["max_length"] = 512
    assert load_config(raw=raw, check_plugins=False).llms["main"].max_length == 512


def test_max_length_honours_model_kwargs_and_relative_positions(tiny):
    raw = {"llms": {"main": {"model": tiny["llama"], "max_length": 2048,
                             "model_kwargs": {"max_position_embeddings": 4096}}}}
    assert load_config(raw=raw, check_plugins=False).llms["main"].max_length == 2048
    t5 = {"llms": {"main": {"model": tiny["t5"], "type": "seq2seq", "max_length": 100_000}}}
    assert load_config(raw=t5, check_plugins=False).llms["main"].max_length == 100_000


# ----------------------------------------------------------------------------- 4. GPU ids and devices: auto


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("RANK", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_gpu_ids_beyond_the_machines_gpus(base, two_gpus):
    base["llms"]["main"].update({"replicas": 2, "devices": [1, 3]})
    message = _problems(base, check_plugins=False)["llms.main.devices"]
    assert "GPU id(s) 3 do not exist" in message and "has 2 GPU(s)" in message
    base["llms"]["main"]["devices"] = [0, 1]
    load_config(raw=base, check_plugins=False)
    base["llms"]["main"]["devices"] = [1, 3]
    load_config(raw=base, check_plugins=False, check_devices=False)  # validate on a login node


def test_auto_with_more_ranks_than_gpus_on_one_node(base, two_gpus):
    base["llms"]["main"].update({"replicas": 3, "devices": "auto"})
    message = _problems(base, check_plugins=False, single_node=True)["llms.main.devices"]
    assert "need GPU ids up to 2" in message and "has 2 GPU(s)" in message
    base["llms"]["main"]["replicas"] = 2
    load_config(raw=base, check_plugins=False, single_node=True)
    # a CPU LLM listed first takes local rank 1 (GPU 0's place): the auto LLM's ranks need GPUs 1 and 2
    raw = {"llms": {"ref": {"model": base["llms"]["main"]["model"]}, **base["llms"]}}
    assert "llms.main.devices" in _problems(raw, check_plugins=False, single_node=True)


def test_auto_inside_a_launched_rank_checks_this_nodes_ranks(base, two_gpus):
    base["llms"]["main"].update({"replicas": 4, "devices": "auto"})
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "LOCAL_SIZE": "5", "CROSS_RANK": "0"}.items():
        two_gpus.setenv(name, value)
    assert "need GPU ids up to 3" in _problems(base, check_plugins=False)["llms.main.devices"]
    # two nodes of 2 GPUs (hostfile: node0 3 slots, node1 2): node1 holds global ranks 3 and 4 on GPUs 0 and 1
    for name, value in {"RANK": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1"}.items():
        two_gpus.setenv(name, value)
    load_config(raw=base, check_plugins=False)


def test_auto_is_not_refused_where_the_run_may_span_nodes(base, two_gpus):
    base["llms"]["main"].update({"replicas": 4, "devices": "auto"})
    load_config(raw=base, check_plugins=False)  # llmrl run with a hostfile: each rank checks its own node


# ----------------------------------------------------------------------------- 5. options the chosen type ignores


@pytest.mark.parametrize("section,value,path,reader", [
    ("training.optimizer", {"type": "adam", "momentum": 0.9}, "training.optimizer.momentum", "type: sgd"),
    ("training.optimizer", {"type": "adamw", "momentum": 0.9}, "training.optimizer.momentum", "type: sgd"),
    ("training.optimizer", {"momentum": 0.9}, "training.optimizer.momentum", "type: sgd"),  # adam by default
    ("training.optimizer", {"type": "sgd", "betas": [0.9, 0.99]}, "training.optimizer.betas", "type: adam"),
    ("training.optimizer", {"type": "sgd", "eps": 1e-6}, "training.optimizer.eps", "type: adam"),
    ("training.lr_schedule", {"type": "constant", "total_steps": 10}, "training.lr_schedule.total_steps",
     "type: linear or type: cosine"),
    ("training.lr_schedule", {"type": "constant", "min_lr_ratio": 0.1}, "training.lr_schedule.min_lr_ratio",
     "type: linear or type: cosine"),
    ("quantization", {"bits": 8, "quant_type": "nf4"}, "quantization.quant_type", "bits: 4"),
    ("quantization", {"bits": 8, "double_quant": True}, "quantization.double_quant", "bits: 4"),
    ("quantization", {"bits": 8, "compute_dtype": "bfloat16"}, "quantization.compute_dtype", "bits: 4"),
])
def test_options_the_chosen_type_does_not_read(base, section, value, path, reader):
    node = base["llms"]["main"]
    *parents, last = section.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    message = _problems(base, check_environment=False, check_plugins=False)[f"llms.main.{path}"]
    assert "does not read" in message and f"only {reader}" in message


def test_options_the_chosen_type_reads_are_accepted(base):
    base["llms"]["main"].update({"quantization": {"bits": 4, "quant_type": "fp4", "double_quant": True},
                                 "training": {"optimizer": {"type": "sgd", "momentum": 0.9, "weight_decay": 0.1},
                                              "lr_schedule": {"type": "cosine", "total_steps": 10,
                                                              "min_lr_ratio": 0.1}}})
    llm = load_config(raw=base, check_environment=False, check_plugins=False).llms["main"]
    assert llm.training.optimizer.momentum == 0.9 and llm.quantization.quant_type == "fp4"
    base["llms"]["main"]["training"] = {"optimizer": {"type": "adamw", "betas": [0.9, 0.95], "eps": 1e-6},
                                        "lr_schedule": {"type": "constant", "warmup_steps": 3}}
    base["llms"]["main"]["quantization"] = {"bits": 8}
    load_config(raw=base, check_environment=False, check_plugins=False)


# ----------------------------------------------------------------------------- 6. misspelt LLM names in overrides


def test_an_override_creating_a_misspelt_llm_suggests_the_existing_name(tiny):
    raw = {"llms": {"policy": {"model": tiny["llama"]}, "critic": {"model": tiny["llama"]}}}
    problems = _problems(raw, overrides=["llms.polcy.replicas=2"], check_plugins=False)
    message = problems["llms.polcy"]
    assert "missing required key 'model'" in message and "did you mean 'policy'?" in message
    # an LLM the config itself defines gets no such hint, nor does a new name close to none
    raw["llms"]["main"] = {"replicas": 2}
    assert "did you mean" not in _problems(raw, check_plugins=False)["llms.main"]
    del raw["llms"]["main"]
    assert "did you mean" not in _problems(raw, overrides=["llms.zzz.replicas=2"], check_plugins=False)["llms.zzz"]
