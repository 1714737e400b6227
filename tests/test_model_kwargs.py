"""The config's ``model_kwargs`` reach the model's constructor exactly as plain Hugging Face receives them, with
``from_pretrained: true`` and ``false``, and ``pad_token_id`` is checked against the tokenizer and the model's
vocabulary. In-process (the live checks, through the servers, are in tests/test_serving_families_live.py)."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config import load_config
from llmrl.engine.model.store.loading import load_model, load_tokenizer, set_pad_token

IDS = torch.tensor([[1, 5, 9, 14, 3, 7]])


def llm_config(model, **extra):
    return load_config(raw={"llms": {"main": {"model": model, **extra}}}, check_plugins=False).llms["main"]


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_model_kwargs_reach_from_pretrained_like_plain_hf(tiny):
    """A model-config key (rms_norm_eps) changes the outputs exactly as plain HF's from_pretrained with the same
    keyword; attn_implementation is used as given."""
    from transformers import AutoModelForCausalLM

    kwargs = {"rms_norm_eps": 0.5, "attn_implementation": "eager"}
    served, _ = load_model(llm_config(tiny["llama"], model_kwargs=kwargs), torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(tiny["llama"], **kwargs).eval()
    default = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    assert served.config._attn_implementation == "eager" and default.config._attn_implementation != "eager"
    assert served.config.rms_norm_eps == 0.5
    torch.testing.assert_close(logits(served), logits(plain), atol=1e-5, rtol=0)
    assert (logits(served) - logits(default)).abs().max() > 1e-2  # the keyword did change the model


def test_model_kwargs_with_random_weights(tiny):
    """from_pretrained: false splits the keywords as from_pretrained does: config keys update the config, the rest
    go to the constructor."""
    served, _ = load_model(llm_config(tiny["llama"], from_pretrained=False,
                                      model_kwargs={"rms_norm_eps": 0.25, "attn_implementation": "eager"}),
                           torch.device("cpu"))
    assert served.config.rms_norm_eps == 0.25 and served.config._attn_implementation == "eager"


def test_unknown_model_kwarg_names_the_config_key(tiny):
    with pytest.raises(TypeError, match=r"llms\.main\.model_kwargs passes \['no_such_argument'\]"):
        load_model(llm_config(tiny["llama"], model_kwargs={"no_such_argument": 1}), torch.device("cpu"))


def test_pad_token_id_overrides_the_tokenizer(tiny):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tiny["gpt2"])
    chosen = plain("a")["input_ids"][0]  # an ordinary token: padding is masked, so any id must do
    assert chosen != plain.pad_token_id
    tok = load_tokenizer(llm_config(tiny["gpt2"], pad_token_id=chosen))
    assert tok.pad_token_id == chosen and tok.pad_token == plain.convert_ids_to_tokens(chosen)
    assert load_tokenizer(llm_config(tiny["gpt2"])).pad_token_id == plain.pad_token_id


def test_pad_token_id_out_of_range_is_refused(tiny):
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(tiny["llama"]))
    with pytest.raises(ValueError, match=rf"llms\.main\.pad_token_id is {size} but the tokenizer has {size} tokens"):
        load_tokenizer(llm_config(tiny["llama"], pad_token_id=size))
    llm = llm_config(tiny["llama"], pad_token_id=size - 1)
    tok = load_tokenizer(llm)
    with pytest.raises(ValueError, match=r"llms\.main\.pad_token_id is \d+ but the model's vocabulary has 100 entries"):
        set_pad_token(tok, llm, vocab_size=100)  # a tokenizer with more tokens than the model's embedding
