"""Config validation: every shipped config is valid; every broken config gets all its errors at once,
each with its dotted path and a hint; overrides; rank counting."""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch

from llmrl.engine.config import load_config, world_size_problem
from llmrl.engine.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_there_are_documented_configs():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"cpu-single.yaml", "cpu-two-replicas.yaml", "cpu-tensor-parallel.yaml", "gpu.yaml",
            "two-nodes.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_is_valid(path):
    config = load_config(path, check_environment=False)
    assert config.world_size >= 2
    if "gpu" in os.path.basename(path) and not torch.cuda.is_available():
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert [p for p, _ in err.value.problems] == ["llms.policy.devices"]
        load_config(path, check_devices=False)  # everything but the GPUs' presence is checked, and passes
    else:
        load_config(path)  # environment checks pass too


def test_two_nodes_config_matches_the_example_hostfile():
    from llmrl.launch.command import hostfile_slots

    config = load_config(os.path.join(ROOT, "configs", "two-nodes.yaml"), check_environment=False)
    with open(os.path.join(ROOT, "hostfile.example")) as f:
        assert sum(hostfile_slots(f.read()).values()) == config.world_size


@pytest.fixture
def base(tiny):
    return {"llms": {"main": {"model": tiny["llama"]}}}


def _mutate(config, path, value):
    node = config
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return config


_DELETE = object()

# (dotted key to set, value, expected problem path, expected words in its message)
BROKEN = [
    ("llms.main.replicas", "2", "llms.main.replicas", "expected integer"),
    ("llm", {}, "llm", "did you mean 'llms'"),
    ("llms.main.replica", 2, "llms.main.replica", "did you mean 'replicas'"),
    ("llms.main.model", _DELETE, "llms.main", "missing required key 'model'"),
    ("llms.main.model", "/nonexistent/models/tiny", "llms.main.model", "does not exist"),
    ("llms.main.dtype", "fp32", "llms.main.dtype", "did you mean 'float32'"),
    ("llms.main.tensor_parallel", 0, "llms.main.tensor_parallel", "must be >= 1"),
    ("llms.main.tensor_parallel", 3, "llms.main.tensor_parallel", "does not divide"),
    ("llms.main.devices", [0, 1, 2], "llms.main.devices", "one id per rank"),
    ("llms.main.devices", "gpu", "llms.main.devices", "write cpu, auto, or a list"),
    ("llms.main.training.zero_stage", 4, "llms.main.training.zero_stage", "is not one of"),
    ("llms.main.training.optimizer.lr", -1, "llms.main.training.optimizer.lr", "must be > 0"),
    # NaN passes JSON Schema's bounds (every comparison with it is false): a NaN lr trained every weight into NaN
    ("llms.main.training.optimizer.lr", float("nan"), "llms.main.training.optimizer.lr", "nan is not a finite number"),
    ("llms.main.training.lr_schedule", {"type": "cosine", "total_steps": 10, "min_lr_ratio": float("nan")},
     "llms.main.training.lr_schedule.min_lr_ratio", "not a finite number"),
    ("llms.main.training.optimizer.eps", float("inf"), "llms.main.training.optimizer.eps", "inf is not a finite"),
    ("llms.main.updater", {"plugin": "grpo", "args": {"clip_eps": float("nan")}}, "llms.main.updater.args.clip_eps",
     "not a finite number"),
    ("timeouts.request", "soon", "timeouts.request", "expected number or null"),
    ("llms.main.heads", {"v": "valu"}, "llms.main.heads.v", "did you mean 'value'"),
    ("llms.main.heads", {"v": {"plugin": "value", "args": {"hidden": "big"}}}, "llms.main.heads.v.args", "hidden"),
    ("llms.main.heads", {"v": {"plugin": "value", "args": {"width": 3}}}, "llms.main.heads.v.args", "width"),
    ("llms.main.heads", {"v": {"plugin": "nosuchmodule.heads:Head"}}, "llms.main.heads.v", "failed"),
    ("llms.main.quantization", {"bits": 4}, "llms.main.quantization", "cannot be tensor-parallel"),
    ("llms", {}, "llms", "at least one"),
    ("llms.my llm", {"model": "x"}, "llms", "not allowed"),
    ("llms.main.checkpoint", "/nonexistent/ckpt", "llms.main.checkpoint", "does not exist"),
    ("seed", -1, "seed", "must be >= 0"),
    ("llms.main.replicas", 2.0, "llms.main.replicas", "expected integer"),
    ("llms.main.training.micro_batch_size", 8.0, "llms.main.training.micro_batch_size", "expected integer"),
    ("timeouts.dead_after", 1.5, "timeouts.dead_after", "must exceed twice timeouts.heartbeat"),
    ("max_message_bytes", 10, "max_message_bytes", "must be >= 1048576"),
    ("llms.main.model_kwargs", ["attn_implementation"], "llms.main.model_kwargs", "expected object, got list"),
    ("llms.main.model_kwargs", "eager", "llms.main.model_kwargs", "such as {attn_implementation: eager}"),
    ("llms.main.model_kwargs", {"torch_dtype": "bfloat16"}, "llms.main.model_kwargs.torch_dtype",
     "cannot be set in llms.main.model_kwargs: llmrl sets it from llms.main.dtype"),
    ("llms.main.model_kwargs", {"dtype": "bfloat16"}, "llms.main.model_kwargs.dtype", "from llms.main.dtype"),
    ("llms.main.model_kwargs", {"device_map": "auto"}, "llms.main.model_kwargs.device_map", "from llms.main.devices"),
    ("llms.main.model_kwargs", {"quantization_config": {}}, "llms.main.model_kwargs.quantization_config",
     "from llms.main.quantization"),
    ("llms.main.model_kwargs", {"trust_remote_code": True}, "llms.main.model_kwargs.trust_remote_code",
     "from llms.main.trust_remote_code"),
    ("llms.main.pad_token_id", -1, "llms.main.pad_token_id", "must be >= 0"),
    ("llms.main.pad_token_id", "eos", "llms.main.pad_token_id", "expected integer or null"),
    ("llms.main.pad_token_id", 3.0, "llms.main.pad_token_id", "expected integer or null"),
    ("llms.main.kv_cache_mb", -1, "llms.main.kv_cache_mb", "must be >= 0"),
    ("llms.main.kv_cache_mb", "1GB", "llms.main.kv_cache_mb", "a size in MB such as 1024"),
    ("llms.main.heads", {"score": "value"}, "llms.main.heads.score", "collides with the 'score' entry of score()'s "
     "results"),
    ("llms.main.heads", {"logprobs": "value"}, "llms.main.heads.logprobs", "rename the head, e.g. 'logprobs_head'"),
    ("llms.main.heads", {"half": "value"}, "llms.main.heads.half", "'half' is the name of a torch.nn.Module "
     "attribute or method"),  # the ModuleDict failed at start-up with a KeyError naming nothing
]


@pytest.mark.parametrize("key,value,path,words", BROKEN,
                         ids=[f"{b[0]} deleted" if b[1] is _DELETE else f"{b[0]}={b[1]!r}" for b in BROKEN])
def test_broken_config_names_the_field(base, key, value, path, words):
    config = _mutate(copy.deepcopy(base), key, value)
    if key == "llms.main.quantization":
        config["llms"]["main"]["tensor_parallel"] = 2
    with pytest.raises(ConfigError) as err:
        load_config(raw=config)
    problems = err.value.problems
    assert any(p == path and words in m for p, m in problems), problems


def test_cuda_devices_on_a_cpu_only_machine(base):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base["llms"]["main"]["devices"] = [0]
    with pytest.raises(ConfigError) as err:
        load_config(raw=base)
    assert err.value.problems == [("llms.main.devices", err.value.problems[0][1])]
    assert "CUDA is not available" in err.value.problems[0][1]


def test_skipping_the_device_check_still_checks_the_rest(base):
    """`llmrl validate` on a login node: the GPUs' presence is not checked, everything else is."""
    base["llms"]["main"]["devices"] = "auto"
    base["llms"]["main"]["model"] = "/no/such/model"
    with pytest.raises(ConfigError) as err:
        load_config(raw=base, check_devices=False)
    assert [p for p, _ in err.value.problems] == ["llms.main.model"]


def test_4bit_without_bitsandbytes(base, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    base["llms"]["main"]["quantization"] = {"bits": 4}
    with pytest.raises(ConfigError) as err:
        load_config(raw=base)
    assert err.value.problems == [("llms.main.quantization",
                                   "needs the bitsandbytes package: pip install bitsandbytes")]


def test_gpt2_cannot_be_tensor_parallel(tiny):
    config = {"llms": {"main": {"model": tiny["gpt2"], "tensor_parallel": 2}}}
    with pytest.raises(ConfigError) as err:
        load_config(raw=config)
    assert any("AutoTP does not support gpt2" in m for _, m in err.value.problems)


def test_every_error_is_reported_at_once(base):
    base["llms"]["main"].update({"replicas": "two", "dtype": "fp32", "replica": 3})
    base["timeouts"] = {"startup": -5}
    with pytest.raises(ConfigError) as err:
        load_config(raw=base)
    paths = sorted(p for p, _ in err.value.problems)
    assert paths == ["llms.main.dtype", "llms.main.replica", "llms.main.replicas", "timeouts.startup"]
    text = str(err.value)
    assert "4 problem(s)" in text and "llms.main.replica: unknown key 'replica'" in text


def test_overrides_are_typed_and_validated(base):
    config = load_config(raw=base, overrides=["llms.main.replicas=3", "seed=7", "llms.main.devices=cpu",
                                              "timeouts.request=null"])
    assert config.llms["main"].replicas == 3 and config.seed == 7 and config.timeouts.request is None
    with pytest.raises(ConfigError) as err:
        load_config(raw=base, overrides=["llms.main.replicass=2", "nonsense"])
    paths = [p for p, _ in err.value.problems]
    assert "nonsense" in paths and "llms.main.replicass" in paths


def test_overrides_reach_list_items_and_read_numbers_as_yaml_1_2(base, tmp_path):
    from llmrl.engine.config.loading import yaml_load

    base["llms"]["main"]["initializers"] = [{"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}]
    base["llms"]["main"]["updater"] = "ppo"
    config = load_config(raw=base, overrides=["llms.main.initializers.0.args.adapters.default.r=16",
                                              "llms.main.training.optimizer.lr=1e-2"])
    assert config.llms["main"].initializers[0].args["adapters"]["default"]["r"] == 16
    assert config.llms["main"].training.optimizer.lr == 0.01
    with pytest.raises(ConfigError) as err:
        load_config(raw=base, overrides=["llms.main.initializers.3.args.x=1", "llms.main.initializers.a=1"])
    messages = dict(err.value.problems)
    assert "is a list of 1 item(s); index it with 0..0" in messages["llms.main.initializers.3.args.x"]
    assert "index it with 0..0" in messages["llms.main.initializers.a"]
    # YAML 1.2 numbers in files too; 1.1's strings and booleans are left as PyYAML reads them
    assert yaml_load("lr: 1e-3\nb: 2.5E+2\nc: -.inf\nd: 1.0.0\ne: 7\nf: yes\ng: '1e-3'") == {
        "lr": 1e-3, "b": 250.0, "c": float("-inf"), "d": "1.0.0", "e": 7, "f": True, "g": "1e-3"}
    (tmp_path / "run.yaml").write_text(f"llms:\n  main:\n    model: {base['llms']['main']['model']}\n    updater: ppo\n"
                                        "    training: {optimizer: {type: adam, lr: 3e-4}}\n")
    assert load_config(tmp_path / "run.yaml").llms["main"].training.optimizer.lr == 3e-4


def test_defaults_are_filled(base):
    llm = load_config(raw=base).llms["main"]
    assert (llm.type, llm.dtype, llm.replicas, llm.tensor_parallel, llm.devices) == ("causal", "float32", 1, 1, "cpu")
    assert llm.training.zero_stage == 0 and llm.updater is None and llm.prefix_reuse
    assert llm.model_kwargs == {} and llm.pad_token_id is None


def test_model_kwargs_and_pad_token_id_are_kept(base):
    base["llms"]["main"].update({"model_kwargs": {"attn_implementation": "eager", "rope_theta": 1000.0},
                                 "pad_token_id": 5})
    llm = load_config(raw=base, overrides=["llms.main.model_kwargs.low_cpu_mem_usage=true"]).llms["main"]
    assert llm.model_kwargs == {"attn_implementation": "eager", "rope_theta": 1000.0, "low_cpu_mem_usage": True}
    assert llm.pad_token_id == 5


def test_world_size_counts_every_rank(base):
    base["llms"]["main"].update({"replicas": 2, "tensor_parallel": 2})
    base["llms"]["critic"] = {"model": base["llms"]["main"]["model"], "replicas": 3}
    config = load_config(raw=base)
    assert config.world_size == 1 + 4 + 3
    assert world_size_problem(config, 8) is None
    message = world_size_problem(config, 5)
    assert "started 5 rank(s) but the config needs 8" in message and "--num_gpus 8" in message


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("llms: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_a_key_given_twice_is_refused_naming_both_lines_and_integers_are_yaml_1_2(base, tmp_path):
    """A review found a second ``training:`` block silently dropping the first's lr, micro-batch and seed, and
    ``seed: 010`` read as 8 (YAML 1.1's octal)."""
    from llmrl.engine.config.loading import yaml_load

    model = base["llms"]["main"]["model"]
    path = tmp_path / "twice.yaml"
    path.write_text(f"llms:\n  main:\n    model: {model}\n    training: {{micro_batch_size: 4}}\n"
                    "    training: {gradient_clipping: 1.0}\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"the key 'training' is given twice \(lines 4 and 5\).*merge the two"):
        load_config(path)
    path.write_text(f"llms:\n  main:\n    model: {model}\nseed: 3\nseed: 0\n")
    with pytest.raises(ConfigError, match=r"the key 'seed' is given twice \(lines 4 and 5\)"):
        load_config(path)
    assert yaml_load("a: {x: 1}\nb:\n  <<: {x: 1, y: 2}\n  x: 3\n") == {"a": {"x": 1}, "b": {"x": 3, "y": 2}}
    assert yaml_load("s: 010\nt: 10:00\nu: 0o17\nv: 0x1f\nw: -7\nx: 08\ny: 1_000\nz: 0b101") == {
        "s": 10, "t": "10:00", "u": 15, "v": 31, "w": -7, "x": 8, "y": "1_000", "z": "0b101"}
    path.write_bytes(b"# r\xe9sum\xe9\nseed: 1\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path)
