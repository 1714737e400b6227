"""What the live serving tests share (tests/test_serving_live.py, tests/test_serving_families_live.py): the inputs
(contexts with boundary merges, an empty context, unicode; token-id probes cut over replicas) and the checks
against plain Hugging Face and plain PyTorch (scores, generate, scoring generated tokens back, heads that read
layers, token hidden states and logits). It starts no run: the tests do."""

from __future__ import annotations

import pytest
import torch

CONTEXTS = ["You see a wall 2 steps forward.", "Goal: go to the red ball", "café ", "東京 is", "x x x",
            "In the kitchen you see a fridge.", "You see a wa", "Possible actions: tu", ""]
CANDIDATES = [[" turn left", " turn right", " go forward", "", "Ünïcödé 🙂"],
              ["pick up", " pick up", "  drop"],
              [],
              ["naïve", " über"],
              [f" c{i}" for i in range(20)],
              [" open fridge", " go north"],
              ["ll 2 steps forward", "lk", " red ball"],
              ["rn right", "rn left", "n"],
              [" a", "x"]]
PROBE_HEADS = {"ctx_layers": {"plugin": "llmrl_test_plugins:ContextLayersHead"},
               "cand_layers": {"plugin": "llmrl_test_plugins:CandidateLayersHead"},
               "token_probe": {"plugin": "llmrl_test_plugins:TokenProbeHead"}}
PROBE_CONTEXTS = [[17, 230, 41, 99, 5], [300, 301], [5, 6, 7, 8]]
PROBE_CANDIDATES = [[[7, 8, 9, 10], [7, 8], [311], []], [[1, 2, 3]], [[10 + k, 11 + k, 3] for k in range(12)]]


def assert_scores(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu" and g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)


def without_empty(contexts, candidates):
    """Drop the empty context (a model without BOS has nothing to condition its candidates on)."""
    keep = [i for i, c in enumerate(contexts) if c]
    return [contexts[i] for i in keep], [candidates[i] for i in keep]


def reference_logprobs(model, tok, prompt, tokens, seq2seq):
    from testkit.models import decoder_start

    with torch.no_grad():
        if seq2seq:
            dec = [decoder_start(model)] + tokens[:-1]
            logits = model(**tok(prompt, return_tensors="pt"), decoder_input_ids=torch.tensor([dec])).logits[0]
            return torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), tokens]
        ids = tok(prompt)["input_ids"]
        logits = model(input_ids=torch.tensor([ids + tokens])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        return torch.stack([logp[len(ids) + t - 1, token] for t, token in enumerate(tokens)])


def assert_scored_back(run, llm, prompts, results):
    """Each sample's tokens, scored back as token-id candidates of its prompt (the prompt as text, tokenised as
    generate tokenised it), give exactly its tokens and generate's per-token log-probs."""
    scored = run.score(prompts, [[s["tokens"] for s in samples] for samples in results], llm=llm, per_token=True)
    for samples, got in zip(results, scored):
        for k, sample in enumerate(samples):
            assert torch.equal(got["tokens"][k], sample["tokens"])
            torch.testing.assert_close(got["logprobs"][k], sample["logprobs"], atol=1e-4, rtol=0)
            assert float(got["score"][k]) == pytest.approx(sample["logprob"], abs=1e-4)


def check_generation(run, llm, model, tok, seq2seq):
    """Greedy samples equal plain HF generate; every sample's log-probs equal a plain forward's; every sample's
    tokens scored back as ids give its log-probs (for every tokenizer: the ids are never re-tokenised)."""
    prompts = CONTEXTS[:8]
    results = run.generate(prompts, llm=llm, max_new_tokens=5, do_sample=False)
    for prompt, samples in zip(prompts, results):
        (sample,) = samples
        with torch.no_grad():
            enc = tok(prompt, return_tensors="pt")
            plain = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)[0]
        plain = (plain[1:] if seq2seq else plain[enc["input_ids"].shape[1]:]).tolist()
        eos = model.generation_config.eos_token_id
        plain = plain[: plain.index(eos) + 1] if eos in plain else plain
        assert sample["tokens"].tolist() == plain
        torch.testing.assert_close(sample["logprobs"], reference_logprobs(model, tok, prompt, plain, seq2seq),
                                   atol=1e-4, rtol=0)
        assert sample["logprob"] == pytest.approx(float(sample["logprobs"].sum()), abs=1e-5)
    assert_scored_back(run, llm, prompts, results)
    first = run.generate(prompts[:2], llm=llm, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=3)
    again = run.generate(prompts[:2], llm=llm, max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=3)
    assert [len(s) for s in first] == [3, 3]
    assert [[s["tokens"].tolist() for s in c] for c in first] == [[s["tokens"].tolist() for s in c] for c in again]
    for prompt, samples in zip(prompts[:2], first):
        for s in samples:
            torch.testing.assert_close(s["logprobs"], reference_logprobs(model, tok, prompt, s["tokens"].tolist(),
                                                                         seq2seq), atol=1e-4, rtol=0)
    assert_scored_back(run, llm, prompts[:2], first)


def requests_served(run, llm: str, kind: str) -> list[int]:
    """How many requests of ``kind`` each replica leader of ``llm`` received so far."""
    servers, stats = run.servers(), run.server_memory()
    return [stats[r]["requests"].get(kind, 0) for r, s in servers.items() if s["llm"] == llm and s["tp_rank"] == 0]


def plain_hidden(model, seq2seq: bool, context: list[int], tokens: list[int]):
    """One unpadded Hugging Face forward with output_hidden_states (seq2seq: the decoder's): per layer (0, 1, -2,
    -1), the hidden states at the context's last token, at the candidate's last token and at the positions that
    predict each token; and the logits there."""
    with torch.no_grad():
        if seq2seq:
            dec = [model.config.decoder_start_token_id] + tokens
            out = model(input_ids=torch.tensor([context]), decoder_input_ids=torch.tensor([dec]),
                        output_hidden_states=True)
            hs, ctx, cand, toks = out.decoder_hidden_states, 0, len(tokens), list(range(len(tokens)))
        else:
            out = model(input_ids=torch.tensor([context + tokens]), output_hidden_states=True)
            n = len(context)
            hs, ctx, cand, toks = out.hidden_states, n - 1, n + len(tokens) - 1, list(range(n - 1, n - 1 + len(tokens)))
    return {layer: (hs[layer][0, ctx], hs[layer][0, cand], hs[layer][0, toks]) for layer in (0, 1, -2, -1)}, \
        out.logits[0, toks].float()


def check_probe_heads(run, llm: str, model, seq2seq: bool):
    """Heads reading layers 0, 1, -2 and -1 at contexts, candidates and scored tokens, and the logits, return what
    plain Hugging Face's output_hidden_states gives; per-context keyword arguments reach their contexts' heads."""
    close = dict(atol=1e-4, rtol=0)
    scale = [1.0, 2.0, 3.0]
    keys = ["ctx_layers", "cand_layers", "token_probe"]
    heads = run.custom_module_fns(keys, PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm,
                                  head_kwargs={"scale": scale, "offset": 5.0})
    scored = run.score(PROBE_CONTEXTS, PROBE_CANDIDATES, llm=llm, additional_module_function_keys=["token_probe"],
                       per_token=True, head_kwargs={"offset": 5.0})
    for i, (context, cands) in enumerate(zip(PROBE_CONTEXTS, PROBE_CANDIDATES)):
        got, tokens = heads[i], heads[i]["token_probe"]
        assert len(tokens["h1"]) == len(cands) and len(scored[i]["token_probe"]["logprob"]) == len(cands)
        for j, cand in enumerate(cands):
            layers, logits = plain_hidden(model, seq2seq, context, cand)
            if j == 0:
                torch.testing.assert_close(got["ctx_layers"]["h0"], layers[0][0], **close)
                torch.testing.assert_close(got["ctx_layers"]["scaled_h1"], scale[i] * layers[1][0], **close)
                torch.testing.assert_close(got["ctx_layers"]["last"], layers[-1][0], **close)
            torch.testing.assert_close(got["cand_layers"]["h0"][j], layers[0][1], **close)
            torch.testing.assert_close(got["cand_layers"]["h_2"][j], layers[-2][1], **close)
            torch.testing.assert_close(tokens["h1"][j], layers[1][2], **close)
            torch.testing.assert_close(tokens["last"][j], layers[-1][2], **close)
            torch.testing.assert_close(tokens["logits"][j], logits, **close)
            torch.testing.assert_close(scored[i]["token_probe"]["logprob"][j], scored[i]["logprobs"][j] + 5.0, **close)
            want = torch.log_softmax(logits, -1)[torch.arange(len(cand)), cand]
            torch.testing.assert_close(scored[i]["logprobs"][j], want, **close)
