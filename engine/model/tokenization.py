"""Turn contexts and candidates into token ids with the semantics of plain Hugging Face.

Causal models: a candidate's tokens are those of ``tokenize(context + candidate)`` (special tokens
such as BOS added as the tokenizer does) that follow its longest common prefix with
``tokenize(context)``. Tokenising the concatenation as a whole keeps boundary merges and spaces
exactly as a user scoring the full text would get them. All candidates of a context share a prefix
(the shortest of those common prefixes): it is encoded once and its cache reused for every candidate.

Seq2seq models: the encoder reads ``tokenize(context)``; the decoder target is
``tokenize(candidate)`` on its own (with the EOS the tokenizer appends).

This module only produces token ids and offsets; it runs no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CandidateTokens:
    """One candidate: the tokens after its context's shared prefix, and which of them are scored.

    ``rest`` continues the shared prefix (causal) or is the whole decoder target (seq2seq);
    tokens ``rest[first_scored:]`` are the candidate's own tokens, whose log-probs are summed.
    """

    rest: list[int]
    first_scored: int

    @property
    def num_scored(self) -> int:
        return len(self.rest) - self.first_scored


@dataclass
class ContextTokens:
    ids: list[int]  # the context tokenised alone
    shared: int  # causal: length of the prefix shared by the context and all its candidates
    candidates: list[CandidateTokens] = field(default_factory=list)

    @property
    def prefix(self) -> list[int]:
        return self.ids[: self.shared]


@dataclass
class TokenPlan:
    kind: str  # "causal" or "seq2seq"
    contexts: list[ContextTokens]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def tokenize(tokenizer, kind: str, contexts: list[str], candidates: list[list[str]] | None, *,
             max_length: int | None, prefix_reuse: bool = True) -> TokenPlan:
    """Tokenise a request. ``candidates=None`` means contexts only (for heads).

    Raises:
        ValueError: an input longer than ``max_length``, or a candidate with no token to condition
            on; the message names the context and candidate index.
    """
    context_ids = _encode(tokenizer, contexts)
    plan = TokenPlan(kind, [])
    for i, ids in enumerate(context_ids):
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"context {i} is {len(ids)} tokens long; this model accepts at most {max_length} "
                             "(llms.<name>.max_length)")
        plan.contexts.append(ContextTokens(ids=ids, shared=len(ids)))
    if candidates is None:
        return plan
    if kind == "seq2seq":
        flat = [c for cands in candidates for c in cands]
        targets = iter(_encode(tokenizer, flat))
        for i, cands in enumerate(candidates):
            for j in range(len(cands)):
                target = next(targets)
                if max_length is not None and len(target) > max_length:
                    raise ValueError(f"candidate {j} of context {i} is {len(target)} tokens long; this model "
                                     f"accepts at most {max_length}")
                plan.contexts[i].candidates.append(CandidateTokens(rest=target, first_scored=0))
        return plan
    flat = [contexts[i] + c for i, cands in enumerate(candidates) for c in cands]
    full_ids = iter(_encode(tokenizer, flat))
    for i, cands in enumerate(candidates):
        ctx = plan.contexts[i]
        fulls = [next(full_ids) for _ in cands]
        common = [common_prefix_length(ctx.ids, full) for full in fulls]
        for j, (full, p) in enumerate(zip(fulls, common)):
            if max_length is not None and len(full) > max_length:
                raise ValueError(f"context {i} with candidate {j} is {len(full)} tokens long; this model accepts "
                                 f"at most {max_length} (llms.<name>.max_length)")
            if p == 0 and len(full) > 0:
                raise ValueError(f"candidate {j} of context {i} has no token to be conditioned on: the context "
                                 "tokenises to nothing before it and the tokenizer adds no BOS token")
        ctx.shared = min([len(ctx.ids), *common]) if prefix_reuse else 0
        for full, p in zip(fulls, common):
            ctx.candidates.append(CandidateTokens(rest=full[ctx.shared:], first_scored=p - ctx.shared))
    return plan
