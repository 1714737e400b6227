"""llmrl's decoding loop against Hugging Face's generate: the same tokens, the raw model's log-probs, the same
seeded samples, and LoRA sampling weights that never touch the trained ones."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from testkit.decoding import plain_logprobs, same_samples

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "café", "x"]
SETTINGS = {  # the loop on a CPU by default, with the adapter merged, and with a static cache and bucketed rows
    "default": {},
    "merged": {"merge_adapter": True},
    "static": {"merge_adapter": True, "static_cache": True, "length_bucket": 16},
}


@pytest.fixture(scope="module")
def lora_llama(reference_models):
    """The tiny Llama with a LoRA adapter whose B is not zero (so that it changes the outputs)."""
    from testkit.models import adapted_llama

    model, tok = reference_models["llama"]
    return adapted_llama(model), tok


def run(model, tok, kwargs, settings=None, seed=None, decoder=None, prompts=PROMPTS):
    if decoder is None and settings is not None:
        decoder = Decoder(GenerationSettings(**settings), "cpu")
    plan = plan_generate(model, tok, "causal", prompts, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=seed, decoder=decoder), decoder


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["llama", "gpt2", "lora"])
def test_greedy_tokens_equal_hugging_face_and_logprobs_equal_a_plain_forward(reference_models, lora_llama, kind,
                                                                            name):
    model, tok = lora_llama if kind == "lora" else reference_models[kind]
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    reference, _ = run(model, tok, kwargs)  # Hugging Face's generate
    ours, decoder = run(model, tok, kwargs, SETTINGS[name])
    assert decoder.stats()["calls"] == {"llmrl": 1}
    assert same_samples(ours, reference)
    merged = kind == "lora" and SETTINGS[name].get("merge_adapter")
    assert decoder.stats()["merges"] == (1 if merged else 0)
    for prompt, (sample,) in zip(PROMPTS, ours):
        expected = plain_logprobs(model, tok, prompt, sample["tokens"].tolist())
        # unmerged: the model's own arithmetic; merged: (W + BA)x rounds differently from Wx + B(Ax) in float32
        torch.testing.assert_close(sample["logprobs"], expected, atol=3e-5 if merged else 1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_seeded_samples_equal_hugging_faces_and_reproduce(lora_llama, name):
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 10, "do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
              "num_return_sequences": 3, "min_new_tokens": 4, "repetition_penalty": 1.3}
    reference, _ = run(model, tok, kwargs, seed=7)
    ours, _ = run(model, tok, kwargs, SETTINGS[name], seed=7)
    again, _ = run(model, tok, kwargs, SETTINGS[name], seed=7)
    other, _ = run(model, tok, kwargs, SETTINGS[name], seed=8)
    assert same_samples(ours, reference) and same_samples(ours, again) and not same_samples(ours, other)
    assert all(len(s["tokens"]) >= 4 for samples in ours for s in samples)  # min_new_tokens held EOS back
    for mine, theirs in zip(ours, reference):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=3e-5, rtol=0)
            torch.testing.assert_close(a["sampling_logprobs"], b["sampling_logprobs"], atol=3e-5, rtol=0)
            assert not torch.allclose(a["logprobs"], a["sampling_logprobs"])  # raw and processed differ


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_repetition_penalty_leaves_left_padding_out_as_hugging_face_does(lora_llama, name):
    """Prompts of different lengths are left-padded in one batch: the penalty counts each row's own tokens only, so a
    padded row's processed log-probs (and, where the pad id is also a token it may emit, its draw) do not depend on
    its neighbours. Before the loop passed the rows' masks, the padded rows' processed log-probs differed from
    Hugging Face's by up to 1e-3."""
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 8, "do_sample": False, "repetition_penalty": 1.3}
    prompts = ["x", "Goal: go to the red ball. You see a wall, a door and a key on the floor.", "café"]
    reference, _ = run(model, tok, kwargs, prompts=prompts)
    ours, _ = run(model, tok, kwargs, SETTINGS[name], prompts=prompts)
    assert same_samples(ours, reference)
    for mine, theirs in zip(ours, reference):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a["sampling_logprobs"], b["sampling_logprobs"], atol=1e-5, rtol=0)


def test_stops_and_eos_end_sequences_as_in_hugging_face(reference_models):
    model, tok = reference_models["llama-eos"]
    kwargs = {"max_new_tokens": 16, "do_sample": True, "num_return_sequences": 4}
    reference, _ = run(model, tok, kwargs, seed=1)
    ours, _ = run(model, tok, kwargs, {}, seed=1)
    assert same_samples(ours, reference)
    assert any(s["stop_reason"] == "stop" for samples in ours for s in samples)  # EOS reached somewhere
    greedy = {"max_new_tokens": 12, "do_sample": False}
    free, _ = run(*reference_models["llama"], greedy, {})
    tokens = free[0][0]["tokens"].tolist()
    stopped, _ = run(*reference_models["llama"], {**greedy, "stop": [tokens[4:6]]}, {})
    hf_stopped, _ = run(*reference_models["llama"], {**greedy, "stop": [tokens[4:6]]})
    assert same_samples(stopped, hf_stopped) and stopped[0][0]["tokens"].tolist() == tokens[:6]
    assert stopped[0][0]["stop"] == tokens[4:6]


def test_checking_for_ended_rows_every_few_steps_changes_no_sample(reference_models, monkeypatch):
    """On CUDA the loop reads back whether every row ended only every few steps; the steps it then runs past the
    last EOS are cut with the rows. Forced on here, the samples are those of a check at every step, and the loop
    did run past the end."""
    from llmrl.engine.model.decoding import loop

    model, tok = reference_models["llama"]
    # a third of the vocabulary ends a sequence: every row ends within a few steps, at different steps
    kwargs = {"max_new_tokens": 40, "do_sample": True, "num_return_sequences": 3,
              "eos_token_id": list(range(3, model.config.vocab_size // 3))}
    widths = []
    original = loop.decode

    def recorded(*args, **kw):
        out = original(*args, **kw)
        widths.append(out.tokens.shape[1])
        return out

    monkeypatch.setattr(loop, "decode", recorded)
    every_step, _ = run(model, tok, kwargs, {}, seed=2)
    every = widths[0] + 1  # the first check after every row ended comes one step late
    monkeypatch.setattr(loop, "finish_interval", lambda device, recorder, keep_cache: every)
    every_five, _ = run(model, tok, kwargs, {}, seed=2)
    assert same_samples(every_five, every_step)
    for a, b in zip(every_step, every_five):
        for x, y in zip(a, b):
            assert torch.equal(x["logprobs"], y["logprobs"]) and torch.equal(x["sampling_logprobs"],
                                                                           y["sampling_logprobs"])
    assert all(s["stop_reason"] == "stop" for samples in every_step for s in samples), "every row ends at EOS"
    assert widths[0] < 40 and widths[1] == every


def _trained_state(model) -> dict:
    return {n: (p.data_ptr(), p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}


def test_merged_weights_never_touch_the_trained_ones_and_follow_the_adapter(lora_llama):
    from llmrl.engine.model.decoding.merged_lora import lora_layers

    model, tok = lora_llama
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    decoder = Decoder(GenerationSettings(merge_adapter=True), "cpu")
    before = _trained_state(model)
    run(model, tok, kwargs, decoder=decoder)
    after = _trained_state(model)
    for name, (ptr, value, grad) in before.items():
        assert after[name][0] == ptr and torch.equal(after[name][1], value) and after[name][2] == grad, name
    assert not any(layer._disable_adapters for layer in lora_layers(model))
    # an in-place change of the adapter (what an optimizer step does) is seen by the next call
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(3.0)
    try:
        ours, _ = run(model, tok, kwargs, decoder=decoder)
        unmerged, _ = run(model, tok, kwargs)
        assert decoder.stats()["merges"] == 2 and same_samples(ours, unmerged)
        run(model, tok, kwargs, decoder=decoder)
        assert decoder.stats()["merges"] == 2  # unchanged adapter: the buffers are reused
    finally:
        with torch.no_grad():
            model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.div_(3.0)


def test_an_error_while_decoding_puts_the_trained_weights_back(lora_llama, monkeypatch):
    from llmrl.engine.model.decoding import loop
    from llmrl.engine.model.decoding.merged_lora import lora_layers

    model, tok = lora_llama
    before = _trained_state(model)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(loop, "decode", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        run(model, tok, {"max_new_tokens": 4}, {"merge_adapter": True})
    after = _trained_state(model)
    assert all(after[n][0] == ptr and torch.equal(after[n][1], v) for n, (ptr, v, _) in before.items())
    assert not any(layer._disable_adapters for layer in lora_layers(model))


def test_requests_the_loop_cannot_run_go_to_hugging_face_or_are_refused(reference_models):
    model, tok = reference_models["llama"]
    beams = {"max_new_tokens": 6, "do_sample": False, "num_beams": 2}
    reference, _ = run(model, tok, beams)
    auto, decoder = run(model, tok, beams, {})
    assert same_samples(auto, reference) and list(decoder.stats()["calls"]) == [
        "hf: the request is not greedy decoding or sampling"]
    with pytest.raises(ValueError, match="generation.decoder is 'llmrl'.*not greedy decoding or sampling"):
        run(model, tok, beams, {"decoder": "llmrl"})
    _, forced_hf = run(model, tok, {"max_new_tokens": 4}, {"decoder": "hf"})
    assert forced_hf.stats()["calls"] == {"hf: configured": 1}
    t5, t5_tok = reference_models["t5"]
    plan = plan_generate(t5, t5_tok, "seq2seq", PROMPTS[:1], {"max_new_tokens": 4}, 8192, 64, 512)
    decoder = Decoder(GenerationSettings(), "cpu")
    generate(t5, t5_tok, "seq2seq", plan, "cpu", decoder=decoder)
    assert list(decoder.stats()["calls"]) == ["hf: the model is seq2seq"]


def test_a_generation_config_field_the_loop_does_not_take_sends_the_request_to_hugging_face(reference_models):
    """A model that ships ``forced_eos_token_id`` forces EOS at the last new token in ``generate``; the loop built
    that processor from the default max_length (20 tokens in all) and forced EOS after 4 new tokens of a 16-token
    prompt. Such requests now go to Hugging Face, and the loop's processors count max_length from the prompt."""
    import copy

    from llmrl.engine.model.decoding.loop import _hf_setup

    model, tok = reference_models["llama"]
    model = copy.copy(model)
    model.generation_config = copy.deepcopy(model.generation_config)
    model.generation_config.forced_eos_token_id = 2
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    prompt = PROMPTS[1]
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = model.generate(ids, pad_token_id=tok.pad_token_id, **kwargs)[0, ids.shape[1]:].tolist()
    (ours,), decoder = run(model, tok, kwargs, {}, prompts=[prompt])
    assert ours[0]["tokens"].tolist() == plain and len(plain) == 12 and plain[-1] == 2
    assert list(decoder.stats()["calls"]) == ["hf: the model's generation config sets ['forced_eos_token_id']"]
    config, _ = _hf_setup(model, ids, {**kwargs, "forced_eos_token_id": 2}, "cpu", torch.ones_like(ids))
    assert config.max_length == ids.shape[1] + 12


@pytest.mark.slow
def test_the_compiled_step_decodes_as_hugging_face_and_compiles_once_per_bucket(lora_llama):
    """The captured-step path (``compile``: torch.compile; on CUDA it replays CUDA graphs) run on the CPU, where
    inductor compiles the same graph: greedy tokens equal Hugging Face's, a second call of the same bucket reuses
    the compiled step and the static cache, and the held memory is reported. The steps attend over windows of the
    cache (its first 32, then all 48 columns, ``attention_window`` 16), both through one compiled step."""
    import shutil

    from torch._dynamo.utils import counters

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("torch.compile on the CPU needs a C compiler")
    model, tok = lora_llama
    kwargs = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False}
    reference, _ = run(model, tok, kwargs)
    settings = GenerationSettings(compile=True, merge_adapter=True, length_bucket=16, attention_window=16)
    decoder = Decoder(settings, "cpu")
    torch._dynamo.reset()  # (a step compiled by an earlier test would be reused: the count below starts afresh)
    compiled_before = counters["stats"]["unique_graphs"]
    first, _ = run(model, tok, kwargs, decoder=decoder)
    again, _ = run(model, tok, kwargs, decoder=decoder)
    assert same_samples(first, reference) and same_samples(again, reference)
    stats = decoder.stats()
    # 4 prompts -> 8 rows; 16 + 20 tokens -> 48 columns, of which the steps fill 17 to 35
    assert stats["compiled_shapes"] == [(8, 48, 32), (8, 48, 48)] and stats["merges"] == 1
    assert counters["stats"]["unique_graphs"] - compiled_before == 1, "one compiled step for every window"
    assert stats["static_cache_mb"] > 0 and stats["merged_weights_mb"] > 0
    for prompt, (sample,) in zip(PROMPTS, first):
        torch.testing.assert_close(sample["logprobs"], plain_logprobs(model, tok, prompt, sample["tokens"].tolist()),
                                   atol=3e-5, rtol=0)


def test_shapes_are_bucketed():
    from llmrl.engine.model.decoding.static_step import bucket

    assert bucket(1, 10, 256) == (8, 256)
    assert bucket(9, 257, 256) == (16, 512)
    assert bucket(64, 600, 128) == (64, 640)
    assert bucket(65, 600, 128) == (128, 640)
    assert bucket(130, 600, 128) == (192, 640)


def test_generation_settings_are_validated():
    from llmrl.engine.config import load_config
    from llmrl.engine.errors import ConfigError

    base = {"llms": {"main": {"model": "m"}}}
    config = load_config(raw={"llms": {"main": {"model": "m", "generation": {"decoder": "hf", "compile": False}}}},
                         check_environment=False, check_plugins=False)
    assert config.llms["main"].generation == GenerationSettings(decoder="hf", compile=False)
    assert load_config(raw=base, check_environment=False, check_plugins=False).llms["main"].generation == \
        GenerationSettings()
    with pytest.raises(ConfigError, match="decoder"):
        load_config(raw={"llms": {"main": {"model": "m", "generation": {"decoder": "fast"}}}},
                    check_environment=False, check_plugins=False)
    for columns in (0, 16, 96):
        assert load_config(raw={"llms": {"main": {"model": "m", "generation": {"attention_window": columns}}}},
                           check_environment=False, check_plugins=False).llms["main"].generation.attention_window \
            == columns
    with pytest.raises(ConfigError, match="attention_window: int 5 .*at least 16"):  # a window per step or two
        load_config(raw={"llms": {"main": {"model": "m", "generation": {"attention_window": 5}}}},
                    check_environment=False, check_plugins=False)


@pytest.mark.parametrize("window,static_used", [(20, False), (64, True)])
def test_a_sliding_window_shorter_than_the_static_cache_decodes_with_a_growing_cache(reference_models, window,
                                                                                     static_used):
    """Mistral's shape with a sliding window: Hugging Face's static sliding layers hold only the window, so where the
    bucketed cache is longer (32 here) the loop grows a cache instead; greedy tokens equal Hugging Face's either way
    (with the static cache they did not: 2 of 3 sequences differed)."""
    from transformers import MistralConfig, MistralForCausalLM

    _, tok = reference_models["llama"]
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=window, max_position_embeddings=256, attn_implementation="sdpa",
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).eval()
    prompts = ["You see a wall and a long corridor with doors", "x", "Goal: go to the red ball now please"]
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    reference, _ = run(model, tok, kwargs, prompts=prompts)
    ours, decoder = run(model, tok, kwargs, {"static_cache": True, "length_bucket": 16}, prompts=prompts)
    assert decoder.stats()["calls"] == {"llmrl": 1}
    assert (decoder.stats()["static_cache_mb"] > 0) == static_used
    assert same_samples(ours, reference)
    for prompt, (sample,) in zip(prompts, ours):
        torch.testing.assert_close(sample["logprobs"], plain_logprobs(model, tok, prompt, sample["tokens"].tolist()),
                                   atol=1e-5, rtol=0)


def test_attention_windows_are_the_filled_columns_rounded_up():
    from llmrl.engine.model.decoding.static_step import window

    assert window(17, 48, 16) == 32 and window(32, 48, 16) == 32 and window(33, 48, 16) == 48
    assert window(65, 512, 64) == 128 and window(257, 512, 64) == 320 and window(512, 512, 64) == 512
    # at most 8 widths per length: 768 columns go by 96, 2048 by 256
    assert window(65, 768, 64) == 96 and window(257, 768, 64) == 288 and window(300, 2048, 64) == 512
    assert window(40, 40, 64) == 40  # never past the cache's length


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 30, "min_new_tokens": 30, "do_sample": False},
                                    {"max_new_tokens": 30, "do_sample": True, "num_return_sequences": 2, "top_k": 0}],
                         ids=["greedy", "sampled"])
def test_static_steps_attending_over_windows_decode_as_over_the_whole_cache(lora_llama, monkeypatch, kwargs):
    """Short prompts and 30 new tokens in a 48-column cache: the steps attend over its first 16, then 32, then all 48
    columns. Tokens equal those of steps over the whole cache (and, greedy, Hugging Face's); log-probs agree to float32
    rounding and equal a plain forward's."""
    from llmrl.engine.model.decoding import static_step

    model, tok = lora_llama
    prompts = ["x", "café", "You see"]
    seen = []
    real_window = static_step.window
    monkeypatch.setattr(static_step, "window", lambda *args: seen.append(real_window(*args)) or seen[-1])
    static = {"merge_adapter": True, "static_cache": True, "length_bucket": 16, "attention_window": 16}
    windowed, decoder = run(model, tok, kwargs, static, seed=5, prompts=prompts)
    assert sorted(set(seen)) == [16, 32, 48] and decoder.stats()["static_cache_mb"] > 0
    if not kwargs["do_sample"]:
        assert len(seen) == 29  # one batch: a window per token fed back (all but the last of 30)
    steps = len(seen)
    whole, _ = run(model, tok, kwargs, {**static, "attention_window": 0}, seed=5, prompts=prompts)
    assert len(seen) == steps, "attention_window: 0 attends over the whole cache"
    for row_windowed, row_whole, prompt in zip(windowed, whole, prompts):
        for a, b in zip(row_windowed, row_whole, strict=True):
            assert a["tokens"].tolist() == b["tokens"].tolist()
            torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-6, rtol=0)
            torch.testing.assert_close(a["logprobs"], plain_logprobs(model, tok, prompt, a["tokens"].tolist()),
                                       atol=1e-5, rtol=0)
    if not kwargs["do_sample"]:
        reference, _ = run(model, tok, kwargs, prompts=prompts)  # Hugging Face's generate
        assert same_samples(windowed, reference)
