"""The frozen trunk kept by ``generate`` (llmrl's decoding loop): the states entering the first adapted layer of
every prompt and sampled token, equal to a plain forward's; an update's first pass over those samples then replays
them instead of running the frozen layers. Reference: plain Hugging Face ``output_hidden_states``, and the same
scoring pass without a trunk."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate
from llmrl.engine.model.reuse.trunk import Trunk, trunk_depth
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.run import accepts_logits_to_keep, run_batch
from llmrl.engine.model.scoring.tokenization import tokenize

PROMPTS = ["Goal: go to the red ball. You see", "The door is locked and", "x"]


@pytest.fixture
def lora_top(reference_models):
    """The tiny Llama (2 layers) with LoRA on its top layer only: a trunk of one layer."""
    from peft import LoraConfig, get_peft_model

    model, tok = reference_models["llama"]
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], layers_to_transform=[1])
    peft = get_peft_model(copy.deepcopy(model), config).eval()
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return peft, tok


def sample(model, tok, decoder, eos_early: bool = False):
    kwargs = {"max_new_tokens": 7, "do_sample": True, "num_return_sequences": 2, "top_k": 0}
    if eos_early:  # make the EOS token likely, so that some rows end early
        kwargs["sequence_bias"] = {(tok.eos_token_id,): 6.0}
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    return generate(model, tok, "causal", plan, "cpu", seed=5, decoder=decoder)


def score_pass(model, tok, contexts, candidates, trunk=None):
    """The per-token log-probs of one scoring pass, as an update's first pass runs it (replaying where it can)."""
    needs = Needs(per_token=True)
    plan = tokenize(tok, "causal", contexts, candidates, max_length=512)
    out = []
    with torch.no_grad(), (trunk.active("replay") if trunk is not None else contextlib.nullcontext()):
        for batch in plan_batches(plan, 8192, 64, needs):
            res = run_batch(model, plan, batch, needs, tok.pad_token_id, "cpu", accepts_logits_to_keep(model),
                            trunk=trunk)
            out.append(res.scores)
    return torch.cat(out)


@pytest.mark.parametrize("llama_step", [True, False], ids=["llama-step", "hf-step"])
@pytest.mark.parametrize("eos_early", [False, True], ids=["full-length", "ended-early"])
def test_generate_keeps_the_trunk_and_the_update_replays_it(lora_top, eos_early, llama_step):
    model, tok = lora_top
    depth = trunk_depth(model)
    assert depth == 1
    trunk = Trunk(model, depth, 1 << 24)
    decoder = Decoder(GenerationSettings(llama_step=llama_step), "cpu", trunk=trunk)
    samples = sample(model, tok, decoder, eos_early)
    assert decoder.stats()["llama_step_batches"] == (1 if llama_step else 0)  # the trunk's hook is handed over
    without = sample(model, tok, Decoder(GenerationSettings(llama_step=False), "cpu"), eos_early)
    assert [[s["tokens"].tolist() for s in g] for g in without] == [[s["tokens"].tolist() for s in g] for g in samples]
    ended = 0
    for prompt, group in zip(PROMPTS, samples):
        ids = tok(prompt)["input_ids"]
        for s in group:
            tokens = s["tokens"].tolist()
            ended += tokens[-1] == tok.eos_token_id and len(tokens) < 7
            path = ids + tokens[:-1]  # what an update feeds: the prompt and every sampled token but the last
            assert trunk.states.held(None, path) == len(path)
            with torch.no_grad():
                want = model(input_ids=torch.tensor([path]), output_hidden_states=True).hidden_states[depth][0]
            _, pieces = trunk.states.match_pieces(None, path)
            got = torch.cat([piece[0][0][0] for piece in pieces])[:len(path)]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (ended > 0) == eos_early
    candidates = [[s["tokens"].tolist() for s in group] for group in samples]
    replayed = score_pass(model, tok, PROMPTS, candidates, trunk)
    assert trunk.replayed_calls > 0 and trunk.whole_calls == 0, trunk.stats()
    torch.testing.assert_close(replayed, score_pass(model, tok, PROMPTS, candidates), atol=1e-5, rtol=0)


def test_no_trunk_is_kept_for_prompts_read_from_the_cache_across_calls_or_a_static_cache(lora_top):
    model, tok = lora_top
    trunk = Trunk(model, trunk_depth(model), 1 << 24)
    sample(model, tok, Decoder(GenerationSettings(static_cache=True, length_bucket=16), "cpu", trunk=trunk))
    assert trunk.states.held_bytes() == 0
