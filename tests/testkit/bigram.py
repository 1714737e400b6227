"""An in-process stand-in for a server's ``Trainer``: a bigram "model" (``log p(token | previous) =
log_softmax(W[previous])[token]``) with a value head ``v[previous]`` (per token, or per context: ``v[context's last
token]``) and a frozen reference ``W0`` (what ``adapters_disabled()`` serves). A built-in updater runs on it with no
servers, so its gradient can be compared with the documented loss written out in plain PyTorch
(:func:`token_logps`)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from llmrl.plugins.contracts import ForwardOutputs
from llmrl.plugins.update_batch import UpdateBatch

VOCAB = 6


class BigramTrainer:
    def __init__(self, seed: int = 0, micro_batch_size: int = 64, ref_shift: float = 0.3, head_level: str = "token"):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g))
        self.v = torch.nn.Parameter(torch.randn(VOCAB, generator=g))
        self.W0 = self.W.detach() + ref_shift * torch.randn(VOCAB, VOCAB, generator=g)
        self.micro_batch_size, self.gradient_accumulation_steps = micro_batch_size, 1
        self.disabled = False
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dW, dv) of each backward
        self.steps = 0
        self.has_adapters = True
        self.head_level = head_level

    def forward(self, contexts, candidates=None, heads=(), peft_adapter=None, *, per_token=False, entropy=False,
                add_eos=False, head_kwargs=None, logits=False, logprobs=True):
        table = torch.log_softmax(self.W0 if self.disabled else self.W, -1)
        lps, owners, entropies, values, candidate_context, counts = [], [], [], [], [], []
        for c, (context, continuations) in enumerate(zip(contexts, candidates)):
            for continuation in continuations:
                previous = context[-1]
                for token in continuation:
                    lps.append(table[previous, token])
                    entropies.append(-(table[previous].exp() * table[previous]).sum())
                    values.append(self.v[previous])
                    owners.append(len(counts))
                    previous = token
                candidate_context.append(c)
                counts.append(len(continuation))
        lp = torch.stack(lps)
        owner = torch.tensor(owners, dtype=torch.long)
        return ForwardOutputs(kind="causal", num_contexts=len(contexts),
                              candidate_scores=torch.zeros(len(counts)).index_add(0, owner, lp),
                              candidate_token_counts=torch.tensor(counts),
                              candidate_context=torch.tensor(candidate_context),
                              heads={h: self._values(values, contexts) for h in heads},
                              head_levels={h: self.head_level for h in heads},
                              token_logprobs=lp, token_candidate=owner,
                              token_entropy=torch.stack(entropies) if entropy else None)

    def _values(self, per_token: list, contexts) -> torch.Tensor:
        return torch.stack(per_token) if self.head_level == "token" else self.v[[c[-1] for c in contexts]]

    def scored_token_counts(self, contexts, candidates, add_eos=False):
        return torch.tensor([len(c) for continuations in candidates for c in continuations])

    def backward(self, loss):
        self.W.grad = self.v.grad = None
        loss.backward()
        self.grads.append((torch.zeros_like(self.W) if self.W.grad is None else self.W.grad.clone(),
                           torch.zeros_like(self.v) if self.v.grad is None else self.v.grad.clone()))

    def step(self):
        self.steps += 1

    def sum_across_replicas(self, values):
        return torch.as_tensor(values, dtype=torch.float64)

    @contextlib.contextmanager
    def adapters_disabled(self):
        self.disabled = True
        try:
            yield
        finally:
            self.disabled = False


def batch(contexts, candidates, **kwargs) -> UpdateBatch:
    """One replica's whole batch."""
    n = len(contexts)
    return UpdateBatch(contexts=contexts, candidates=candidates, kwargs=kwargs, indices=list(range(n)),
                       global_size=n, replica=0, num_replicas=1, replica_sizes=[n], per_sample_keys=tuple(kwargs))


def token_logps(W: torch.Tensor, context: list[int], tokens: list[int]) -> torch.Tensor:
    table = torch.log_softmax(W, -1)
    return torch.stack([table[previous, token] for previous, token in zip([context[-1], *tokens[:-1]], tokens)])


def two_replicas(whole: UpdateBatch, shares: list[list[int]], make_trainer, make_updater) -> list[torch.Tensor]:
    """Run one update on two in-process replicas (two threads, each with its own trainer and updater, whose
    ``sum_across_replicas`` sums the two) holding the samples at ``shares``; returns each replica's gradient of
    ``W`` summed over its micro-steps (DeepSpeed would average the two)."""
    import threading

    barrier, parts, grads, errors = threading.Barrier(2), {}, {}, []
    sizes = [len(s) for s in shares]

    def replica(r: int):
        def sum_across_replicas(values):
            parts[r] = torch.as_tensor(values, dtype=torch.float64)
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            return total

        try:
            trainer = make_trainer()
            trainer.sum_across_replicas = sum_across_replicas
            share = replace(whole, replica=r, num_replicas=2).select(shares[r], sizes)
            make_updater().update(share, trainer)
            grads[r] = sum(g[0] for g in trainer.grads)
        except Exception as error:  # raised in the caller's thread below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return [grads[0], grads[1]]
