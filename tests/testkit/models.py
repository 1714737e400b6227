"""Tiny model folders and plain Hugging Face references for tests.

``tiny_model("llama" | "gpt2" | "t5")`` saves a tiny random model (:mod:`llmrl.engine.model.store.tiny_models`) as a
normal Hugging Face folder and returns its path; folders are cached per (kind, seed) under
``$LLMRL_TEST_MODELS``. ``reference_scores`` computes what ``score`` must return the plain way: one full
forward per (context, candidate) pair, no padding, no cache. ``adapted_llama`` gives the decoding tests their LoRA
model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def tiny_model(kind: str, seed: int = 0, root: str | os.PathLike | None = None) -> str:
    """Path of a saved tiny model folder (built once per kind and seed)."""
    root = Path(root or os.environ.get("LLMRL_TEST_MODELS", Path(tempfile.gettempdir()) / "llmrl-tiny-models"))
    path = root / f"{kind}-seed{seed}"
    if (path / "config.json").is_file():
        return str(path)
    root.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _build(kind, seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return str(path)


def _build(kind: str, seed: int):
    """The product's tiny models, and two variants that exercise rare tokenizer and config shapes:
    ``llama-eos`` (a causal tokenizer that appends EOS) and ``t5-genstart`` (a seq2seq model whose decoder
    start token is only in its generation config)."""
    from llmrl.engine.model.store.tiny_models import build_tiny, tiny_tokenizer

    if kind == "llama-eos":
        model, _ = build_tiny("llama", seed)
        return model, tiny_tokenizer(add_bos=True, add_eos=True)
    if kind == "t5-genstart":
        model, tokenizer = build_tiny("t5", seed)
        model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id
        model.config.decoder_start_token_id = None
        return model, tokenizer
    return build_tiny(kind, seed)


def decoder_start(model) -> int:
    start = model.config.decoder_start_token_id
    return model.generation_config.decoder_start_token_id if start is None else start


def reference_scores(model, tokenizer, contexts: list[str], candidates: list[list[str]], seq2seq: bool = False):
    """Plain Hugging Face scores: one unpadded forward per pair, sum of the candidate's token log-probs (float32, or
    float64 for a float64 model)."""
    import torch

    results = []
    with torch.no_grad():
        for context, cands in zip(contexts, candidates):
            row = []
            for cand in cands:
                if seq2seq:
                    enc = tokenizer(context, return_tensors="pt")
                    target = tokenizer(cand)["input_ids"]
                    if not target:
                        row.append(0.0)
                        continue
                    dec = [decoder_start(model)] + target[:-1]
                    logits = model(**enc, decoder_input_ids=torch.tensor([dec])).logits[0]
                    lp = torch.log_softmax(logits.float(), -1)
                    row.append(sum(lp[t, tok].item() for t, tok in enumerate(target)))
                    continue
                ctx_ids = tokenizer(context)["input_ids"]
                full = tokenizer(context + cand)["input_ids"]
                p = 0
                while p < min(len(ctx_ids), len(full)) and ctx_ids[p] == full[p]:
                    p += 1
                if p == len(full):
                    row.append(0.0)
                    continue
                if p == 0:
                    raise ValueError(f"candidate {cand!r} of context {context!r} has no token to be conditioned on")
                logits = model(input_ids=torch.tensor([full])).logits[0]
                lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
                row.append(sum(lp[t - 1, full[t]].item() for t in range(p, len(full))))
            results.append(torch.tensor(row, dtype=torch.promote_types(model.dtype, torch.float32)))
    return results


def adapted_llama(model, targets=("q_proj", "v_proj", "down_proj")):
    """A copy of ``model`` (the tiny Llama) with a LoRA adapter (r 4) whose B is not zero, so that it changes the
    outputs; seeded, so every copy holds the same adapter."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=list(targets),
                                                           init_lora_weights=False)).eval()
