"""Several LoRA adapters in one training or scoring pass (engine/model/token_adapters.py): each sequence names its
adapter, and every token of the pass runs on it. Checked in process against plain PEFT with that adapter set
(``set_adapter``), one sequence at a time: per-token log-probs agree to float32 rounding (1e-5 absolute and
relative), and the gradients of a loss over every sequence equal, adapter by adapter, the gradients of that adapter's
sequences' losses alone (1e-5 absolute, 1e-4 relative: float32 sums in another order), with no gradient reaching an
adapter from another's sequences. Covered: the unpacked layout (a row per context, candidate rows after their
context), the packed layout (contexts of different adapters side by side in one row), tight budgets (many batches),
contexts sharing a prefix across adapters (no shared pass is run over it), an adapter of the output layer (which reads
the kept positions only), and one layer in bfloat16 against PEFT's own forward. The refusals are checked too."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.module import ModelWithHeads
from llmrl.engine.model.scoring.planning import Needs, plan_batches
from llmrl.engine.model.scoring.tokenization import tokenize
from llmrl.engine.model.token_adapters import TokenAdapters
from testkit.lora_tenants import four_adapters

TEXTS = ["You see a wall. go forward", "Goal: go to the red ball. You turn left", "x y", "a red key is here",
         "the door is open", "You see a wall. turn right", "Goal: go to the red ball. You pick it up"]
NAMES = ["red", "green", "teal", "blue", "green", "blue", "red"]
CALL = ("red", "green", "teal", "blue")


@pytest.fixture(scope="module")
def adapters(reference_models):
    """The tiny Llama with four LoRA adapters of random weights (testkit/lora_tenants.py); blue adapts the output
    layer too."""
    return four_adapters(reference_models, blue_on_output=True)


def sequences(tok, texts=TEXTS):
    return [tok(text)["input_ids"] for text in texts]


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def adapter_of(param_name: str) -> str:
    return next(name for name in CALL if f".{name}." in param_name)


def mixed_pass(model, tok, seqs, names, weights, budget=8192, rows=64, packed=False):
    """The engine's pass over the sequences, each on its adapter: per-token log-probs, and each LoRA weight's
    gradient of ``sum(weights[i] * logprobs[i])``."""
    plan = tokenize(tok, "causal", [s[:1] for s in seqs], [[s[1:]] for s in seqs], max_length=512,
                    vocab_size=model.config.vocab_size)
    for ctx, name in zip(plan.contexts, names):
        ctx.adapter = name
    needs = Needs(per_token=True)
    batches = plan_batches(plan, budget, rows, needs, packed=packed)
    module = ModelWithHeads(model, {}, "causal", tok.pad_token_id, None)
    params = lora_params(model)
    for p in params.values():
        p.requires_grad_(True)
        p.grad = None
    with TokenAdapters(CALL).hooked(model):
        out = module(plan, batches, needs)
    logprobs = list(out.token_logprobs.split(out.candidate_token_counts.tolist()))
    sum(w * lp.sum() for w, lp in zip(weights, logprobs)).backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    return [lp.detach() for lp in logprobs], grads, batches


def plain_pass(model, seqs, names, weights):
    """Plain PEFT, one sequence at a time with its adapter set: per-token log-probs and the summed gradients."""
    params = lora_params(model)
    for p in params.values():
        p.grad = None
    logprobs = []
    for seq, name, w in zip(seqs, names, weights):
        model.set_adapter(name)  # (PEFT makes only this adapter's weights trainable)
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        (w * lp.sum()).backward()
        logprobs.append(lp.detach())
    for p in params.values():
        p.requires_grad_(True)
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    return logprobs, grads


WEIGHTS = [1.0, -0.5, 2.0, 0.75, 1.5, -1.0, 0.3]


@pytest.mark.parametrize("budget,rows,packed", [(8192, 64, False), (24, 2, False), (8192, 64, True)],
                         ids=["one batch", "tight", "packed"])
def test_each_token_runs_on_its_sequences_adapter_with_its_gradients(adapters, budget, rows, packed):
    model, tok = adapters
    seqs = sequences(tok)
    got, got_grads, batches = mixed_pass(model, tok, seqs, NAMES, WEIGHTS, budget, rows, packed)
    assert (len(batches) > 2) == (budget == 24)
    assert all(b.packed == packed for b in batches)
    if packed:  # contexts of several adapters share the packed call
        assert any(len({NAMES[i] for i in b.contexts}) > 1 for b in batches)
    want, want_grads = plain_pass(model, seqs, NAMES, WEIGHTS)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    reached = set()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4)
        if grad.abs().sum() > 0:
            reached.add(adapter_of(name))
    assert reached == set(CALL)  # every adapter had sequences, and got its own gradients


def test_a_shared_prefix_of_several_adapters_gets_no_shared_pass(adapters):
    """Three contexts that share a long prefix: on one adapter the planner encodes it once; on several it encodes
    each context's own, and the results are each adapter's."""
    model, tok = adapters
    prefix = tok("Goal: go to the red ball and then open the door. You see a wall.")["input_ids"]
    texts = [" go forward", " turn left", " turn right"]
    contexts = [prefix] * 3
    candidates = [[tok(t, add_special_tokens=False)["input_ids"]] for t in texts]
    plan = tokenize(tok, "causal", contexts, candidates, max_length=512, vocab_size=model.config.vocab_size)
    assert plan_batches(plan, 8192, 64, Needs(per_token=True))[0].common == len(prefix)
    for ctx, name in zip(plan.contexts, ["red", "blue", "red"]):
        ctx.adapter = name
    (batch,) = plan_batches(plan, 8192, 64, Needs(per_token=True))
    assert batch.common == 0
    seqs = [prefix + c[0] for c in candidates]
    names = ["red", "blue", "red"]
    got, _, _ = mixed_pass(model, tok, seqs, names, [1.0, 1.0, 1.0])
    want, _ = plain_pass(model, seqs, names, [1.0, 1.0, 1.0])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base_dtype,adapter_dtype", [(torch.bfloat16, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16)])
def test_one_layer_in_half_precision_adds_as_peft_does(base_dtype, adapter_dtype):
    """A LoRA layer over tokens of two adapters, against PEFT's forward with each token's adapter set: the product
    in the adapter's dtype, the sum in the wider dtype, rounded to the base output's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(16, 8)), LoraConfig(
        r=4, lora_alpha=6, init_lora_weights=False, target_modules=["0"]), adapter_name="one")
    model.add_adapter("two", LoraConfig(r=2, lora_alpha=5, init_lora_weights=False, target_modules=["0"]))
    layer = model.base_model.model[0]
    layer.base_layer.to(base_dtype)
    for name in ("one", "two"):
        layer.lora_A[name].to(adapter_dtype)
        layer.lora_B[name].to(adapter_dtype)
    x = torch.randn(3, 5, 16).to(base_dtype)
    owner = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    tokens = TokenAdapters(("one", "two"))

    class Rows:
        def __init__(self, row, columns, adapter):
            self.row, self.columns, self.adapter = row, columns, adapter

    rows = [Rows(r, [c], ("one", "two")[int(owner[r, c])]) for r in range(3) for c in range(5)]
    with tokens.hooked(model), tokens.model_call(rows, owner.shape, x.device):
        got = model(x)
    want = torch.empty_like(got)
    for k, name in enumerate(("one", "two")):
        model.set_adapter(name)
        out = model(x)
        want[owner == k] = out[owner == k]
    assert got.dtype == want.dtype == base_dtype
    assert torch.equal(got, want)


def test_what_cannot_be_routed_is_refused(adapters):
    from peft import LoraConfig, get_peft_model

    model, _ = adapters
    model.merge_adapter(["red"])
    try:
        with pytest.raises(ValueError, match="merged"), TokenAdapters(CALL).hooked(model):
            pass
    finally:
        model.unmerge_adapter()
    assert not any("forward" in vars(m) for m in model.modules())
    dora = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), LoraConfig(
        r=2, target_modules=["0"], use_dora=True), adapter_name="d")
    with pytest.raises(ValueError, match="LoRA variant"), TokenAdapters(("d",)).hooked(dora):
        pass
    saved = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), LoraConfig(
        r=2, target_modules=["0"], modules_to_save=["1"]), adapter_name="s")
    with pytest.raises(ValueError, match="modules_to_save"), TokenAdapters(("s",)).hooked(saved):
        pass


def test_positions_follow_the_call_its_kept_logits_and_nothing_outside_a_call():
    tokens = TokenAdapters(("a",))

    class Row:
        row, columns, adapter = 0, [0, 1], "a"

    with tokens.model_call([Row()], (1, 4), "cpu"):
        assert tokens.positions(4, "cpu")[0].tolist() == [0, 1]
        with pytest.raises(RuntimeError, match="cannot be matched"):
            tokens.positions(3, "cpu")
    with tokens.model_call([Row()], (1, 4), "cpu", logits_to_keep=3):  # the output layer reads the last 3 columns
        assert tokens.positions(3, "cpu")[0].tolist() == [0]
    with tokens.model_call([Row()], (1, 4), "cpu", logits_to_keep=torch.tensor([[False, True, False, True]])):
        assert tokens.positions(2, "cpu")[0].tolist() == [0]
    with pytest.raises(RuntimeError, match="outside a model call"):
        tokens.positions(3, "cpu")
    with tokens.throwaway():  # lockstep padding: the base weights alone
        assert [len(p) for p in tokens.positions(3, "cpu")] == [0]
