"""Tiny random Hugging Face models, built in-process with no download: the ``builtin:tiny-random-llama`` model,
and the two-layer Llama, GPT-2 and T5 models that tests and plugin authors use.

Each comes with a small byte-level BPE tokenizer trained on a built-in corpus (any unicode text encodes):
Llama adds a BOS token, T5 appends EOS, GPT-2 adds nothing. Weights are drawn from a seeded generator, so a
kind and a seed always give the same model.

This module builds models; it does not save or cache them (:mod:`llmrl.engine.model.store.builtin_models` does).
"""

from __future__ import annotations

_CORPUS = [
    "You see a wall 2 steps forward, a red ball 1 step left and 2 steps forward.",
    "Goal of the agent: go to the red ball. Possible actions: turn left, turn right, go forward.",
    "pick up the blue key, open the door, drop the box, toggle the switch",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }",
    "Ünïcödé tëxt: café, naïve, über, smörgåsbord, 東京, Ελληνικά, эксперимент, 🙂",
    "In the kitchen you see a fridge, a table and a door leading north.",
    "Language models as policies: score the admissible actions, sample one, update with PPO.",
]

SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def tiny_tokenizer(add_bos: bool, add_eos: bool, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a small built-in corpus (any unicode text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    single = "$A"
    special = []
    if add_bos:
        single = "<s> " + single
        special.append(("<s>", tok.token_to_id("<s>")))
    if add_eos:
        single = single + " </s>"
        special.append(("</s>", tok.token_to_id("</s>")))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def build_tiny(kind: str, seed: int = 0):
    """(model, tokenizer) of a tiny random model: llama (causal, BOS), gpt2 (causal, no BOS), t5 (seq2seq)."""
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    tokenizer = tiny_tokenizer(add_bos=(kind == "llama"), add_eos=(kind == "t5"))
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=vocab, max_position_embeddings=512,
                             bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=vocab,
                            bos_token_id=ids["eos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
        model = GPT2LMHeadModel(config)
    elif kind == "t5":
        config = T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                          vocab_size=vocab, decoder_start_token_id=ids["pad"], eos_token_id=ids["eos"],
                          pad_token_id=ids["pad"], relative_attention_num_buckets=8)
        model = T5ForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use llama, gpt2 or t5")
    with torch.no_grad():  # random init is small; widen it so that scores differ visibly between candidates
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.eval()
    model.generation_config.pad_token_id = ids["pad"]
    return model, tokenizer
