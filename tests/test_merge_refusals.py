"""Adapters whose merge into a copy of the base weight would decode from another model are decoded unmerged:
a LoRA with a bias (``lora_bias``: PEFT adds B's bias to the output, which ``W + s * B @ A`` leaves out), a LoRA on
a weight tied to another layer (the output layer tied to the embeddings: the merged copy would also replace the
embeddings), an adapter PEFT merged into the base weights itself (merging again would add it twice), and DoRA.
Each is checked against Hugging Face's own ``generate`` on the PEFT model: the same tokens, and log-probs within
float32 rounding of a plain forward (what ``score`` computes)."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.config.types import GenerationSettings
from llmrl.engine.model.decoding.runtime import Decoder
from llmrl.engine.model.generation import generate, plan_generate

PROMPTS = ["You see a wall", "Goal: go to the red ball. You", "x"]


def adapted(reference_models, tied: bool, **lora) -> tuple:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model, tok = reference_models["llama"]
    config = model.config.to_dict() | {"tie_word_embeddings": tied}
    torch.manual_seed(0)
    base = LlamaForCausalLM(type(model.config)(**config)).eval()
    if tied:
        assert base.lm_head.weight is base.model.embed_tokens.weight
    peft_model = get_peft_model(base, LoraConfig(r=4, init_lora_weights=False, **lora)).eval()
    with torch.no_grad():  # B's bias is zero at initialisation: make it count
        for name, param in peft_model.named_parameters():
            if "lora_B" in name and name.endswith(".bias"):
                param.normal_(0, 0.5)
    return peft_model, tok


CASES = {
    "lora_bias": ({"target_modules": ["q_proj", "v_proj", "down_proj"], "lora_bias": True}, False, "bias"),
    "tied lm_head": ({"target_modules": ["q_proj", "lm_head"]}, True, "shared"),
    "dora": ({"target_modules": ["q_proj", "v_proj"], "use_dora": True}, False, "variant"),
    "merged by peft": ({"target_modules": ["q_proj", "v_proj"]}, False, "merged into the base weight by PEFT"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_adapter_that_cannot_merge_exactly_decodes_unmerged_as_hugging_face(reference_models, case):
    from llmrl.engine.model.decoding.merged_lora import lora_layers, shared_weights, why_not_mergeable

    lora, tied, reason = CASES[case]
    model, tok = adapted(reference_models, tied, **lora)
    if case == "merged by peft":
        model.merge_adapter()  # W + B A written into the base weights; PEFT's forward then skips the branch
    inner = model.get_base_model()
    assert reason in why_not_mergeable(lora_layers(inner), "default", shared=shared_weights(inner))
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    plan = plan_generate(model, tok, "causal", PROMPTS, kwargs, 8192, 64, 512)
    reference = generate(model, tok, "causal", plan, "cpu")  # Hugging Face's generate on the PEFT model
    decoder = Decoder(GenerationSettings(merge_adapter=True), "cpu")
    ours = generate(model, tok, "causal", plan, "cpu", decoder=decoder)
    assert decoder.stats()["calls"] == {"llmrl": 1} and decoder.stats()["merges"] == 0
    for prompt, (mine,), (theirs,) in zip(PROMPTS, ours, reference):
        assert mine["tokens"].tolist() == theirs["tokens"].tolist()
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + mine["tokens"].tolist()])).logits[0, len(ids) - 1:-1]
        plain = torch.log_softmax(logits.float(), -1).gather(-1, mine["tokens"][:, None])[:, 0]
        torch.testing.assert_close(mine["logprobs"], plain, atol=1e-5, rtol=0)
