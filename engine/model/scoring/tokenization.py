"""Turn contexts and candidates into token ids with the semantics of plain Hugging Face.

Causal models: a candidate's tokens are those of ``tokenize(context + candidate)`` (special tokens
such as BOS added as the tokenizer does) that follow its longest common prefix with
``tokenize(context)``. Tokenising the concatenation as a whole keeps boundary merges and spaces
exactly as a user scoring the full text would get them. All candidates of a context share a prefix
(the shortest of those common prefixes): it is encoded once and its cache reused for every candidate.

Seq2seq models: the encoder reads ``tokenize(context)``; the decoder target is
``tokenize(candidate)`` on its own (with the EOS the tokenizer appends).

Token ids (a list of ints instead of a string) are used exactly as given: no BOS, no EOS, no re-tokenisation. A
context of ids is the prefix (causal) or the encoder input (seq2seq); a candidate of ids is exactly the tokens
scored (causal: after the whole context, tokenised alone if it is a string; seq2seq: the decoder target). A
string candidate of a context given as ids is refused. With ``add_eos`` every candidate's scored tokens end with
the tokenizer's EOS token (appended unless the tokenizer already put it there), as Lamorel's
``add_eos_on_candidates``.

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


@dataclass
class ContextTokens:
    ids: list[int]  # the context tokenised alone
    shared: int  # causal: length of the prefix shared by the context and all its candidates
    candidates: list[CandidateTokens] = field(default_factory=list)
    adapter: str | None = None  # its LoRA adapter, in a pass whose contexts name their own (token_adapters)

    @property
    def prefix(self) -> list[int]:
        return self.ids[: self.shared]


@dataclass
class TokenPlan:
    kind: str  # "causal" or "seq2seq"
    contexts: list[ContextTokens]

    def scored_counts(self) -> list[int]:
        """Each candidate's number of scored tokens (its own tokens, ``rest[first_scored:]``), in order: what a
        forward pass of this plan counts (``candidate_token_counts``), known before any model call."""
        return [max(len(c.rest) - c.first_scored, 0) for ctx in self.contexts for c in ctx.candidates]


def common_prefix_length(*seqs: list[int]) -> int:
    """Length of the prefix shared by every sequence (0 for fewer than two)."""
    if len(seqs) < 2:
        return 0
    first, n = seqs[0], min(len(q) for q in seqs)
    i = 0
    while i < n and all(q[i] == first[i] for q in seqs):
        i += 1
    return i


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def encode_inputs(tokenizer, items: list, vocab_size: int | None, name: str = "contexts") -> list[list[int]]:
    """Each item's token ids: strings tokenised (in one batch, special tokens added), id lists checked against the
    vocabulary and kept as given."""
    texts = [x for x in items if isinstance(x, str)]
    encoded = iter(_encode(tokenizer, texts))
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            out.append(next(encoded))
        else:
            if not x:
                raise ValueError(f"{name}[{i}] is an empty list of token ids; an input needs at least one token")
            check_ids(x, vocab_size, f"{name}[{i}]")
            out.append(list(x))
    return out


def check_ids(ids: list[int], vocab_size: int | None, where: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (the client has already refused what is not an int)."""
    for k, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 or \
                (vocab_size is not None and token >= vocab_size):
            raise ValueError(f"{where}[{k}] is {token!r}, not a token id of this model (0 <= id < {vocab_size})")


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS token id (what ``add_eos`` appends)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("add_eos=True, but this model's tokenizer has no EOS token (tokenizer.eos_token_id is None)")
    return eos


def tokenize(tokenizer, kind: str, contexts: list, candidates: list[list] | None, *,
             max_length: int | None, prefix_reuse: bool = True, add_eos: bool = False,
             vocab_size: int | None = None) -> TokenPlan:
    """Tokenise a request. ``candidates=None`` means contexts only (for heads). Contexts and candidates are strings
    or lists of token ids (see the module's docstring).

    Raises:
        ValueError: an input longer than ``max_length``, a candidate with no token to condition on, an id outside
            ``[0, vocab_size)``, a string candidate of a context given as ids, ``add_eos`` without an EOS token;
            the message names the context and candidate index.
    """
    context_ids = encode_inputs(tokenizer, contexts, vocab_size)
    eos = eos_id(tokenizer) if add_eos and candidates is not None else None
    plan = TokenPlan(kind, [])
    for i, ids in enumerate(context_ids):
        if max_length is not None and len(ids) > max_length:
            raise ValueError(f"context {i} is {len(ids)} tokens long; this model accepts at most {max_length} "
                             "(llms.<name>.max_length)")
        plan.contexts.append(ContextTokens(ids=ids, shared=len(ids)))
    if candidates is None:
        return plan
    for i, cands in enumerate(candidates):
        for j, c in enumerate(cands):
            if isinstance(c, str) and not isinstance(contexts[i], str):
                raise ValueError(f"candidates[{i}][{j}] is a string but contexts[{i}] is a list of token ids; give "
                                 "the candidate as token ids too")
            if not isinstance(c, str):
                check_ids(c, vocab_size, f"candidates[{i}][{j}]")
    if kind == "seq2seq":
        flat = [c for cands in candidates for c in cands if isinstance(c, str)]
        encoded = iter(_encode(tokenizer, flat))
        for i, cands in enumerate(candidates):
            for j, c in enumerate(cands):
                target = next(encoded) if isinstance(c, str) else list(c)
                if eos is not None and (not target or target[-1] != eos):
                    target = target + [eos]
                if max_length is not None and len(target) > max_length:
                    raise ValueError(f"candidate {j} of context {i} is {len(target)} tokens long; this model "
                                     f"accepts at most {max_length}")
                plan.contexts[i].candidates.append(CandidateTokens(rest=target, first_scored=0))
        return plan
    flat = [contexts[i] + c for i, cands in enumerate(candidates) for c in cands if isinstance(c, str)]
    full_ids = iter(_encode(tokenizer, flat))
    for i, cands in enumerate(candidates):
        ctx = plan.contexts[i]
        fulls, common = [], []
        for c in cands:
            if isinstance(c, str):  # the concatenation tokenised as a whole: boundary merges kept
                full = next(full_ids)
                p = common_prefix_length(ctx.ids, full)
            else:  # ids follow the whole context, exactly as given
                full, p = ctx.ids + list(c), len(ctx.ids)
            if eos is not None and (len(full) == p or full[-1] != eos):
                full = full + [eos]
            fulls.append(full)
            common.append(p)
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
