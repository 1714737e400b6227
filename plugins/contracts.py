"""The three plugin contracts (:class:`Head`, :class:`Initializer`, :class:`Updater`) and what they receive.

A plugin is a class. The config names it (entry-point name, ``module:attr`` or ``__main__:Name``)
with keyword arguments for its constructor; an optional ``args_schema`` class attribute (a JSON
Schema) lets the config be checked before any model loads. Every hook is documented below; a class
that breaks the contract is rejected at load time with a message naming the plugin and the hook
(:func:`llmrl.plugins.checks.check_contract`). What an updater receives, :class:`UpdateBatch`, is in
:mod:`llmrl.plugins.update_batch` (and importable from here).

Besides the contracts' shapes and documentation, it holds only what every plugin reads them through:
:class:`ForwardOutputs`' two padded views (per candidate's tokens, per context's candidates) and
:class:`ShufflingUpdater`'s seeded minibatch order. It holds no RL maths (:mod:`llmrl.plugins.rl_math`), no
discovery (:mod:`llmrl.plugins.registry`) and no checks (:mod:`llmrl.plugins.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from llmrl.engine.graph import keep_in_graph
from llmrl.plugins.trainer_api import Trainer
from llmrl.plugins.update_batch import UpdateBatch

__all__ = ["ForwardOutputs", "Head", "Initializer", "LLMInfo", "ShufflingUpdater", "Trainer", "UpdateBatch",
           "Updater"]


@dataclass(frozen=True)
class LLMInfo:
    """What a plugin may know about the LLM it is attached to."""

    name: str
    kind: str  # "causal" or "seq2seq"
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    hf_config: Any = None
    tokenizer: Any = None


class ForwardOutputs(NamedTuple):
    """The outputs of one forward pass over contexts and their candidates, with explicit boundaries.

    Candidates are flattened in context order; ``candidate_context[k]`` is the index of the context
    of candidate ``k``. Heads never have to guess token positions: the hidden states they need are
    taken at the right token by the engine. (A named tuple: DeepSpeed's ZeRO-3 hooks find the tensors
    inside it, as they must for backward passes to gather partitioned weights.)

    Attributes:
        kind: "causal" or "seq2seq".
        num_contexts: number of contexts in this pass.
        candidate_scores: ``[n_candidates]`` sum of the candidate tokens' log-probs (differentiable in updates).
        candidate_token_counts: ``[n_candidates]`` number of tokens in each candidate.
        candidate_context: ``[n_candidates]`` context index of each candidate.
        context_hidden: ``[n_contexts, H]`` last-layer hidden state at each context's last token (causal: the last
            token of the context tokenised alone; seq2seq: the decoder's start position, which reads the whole
            encoded context). Present when a head asks for it (``Head.needs_context_hidden``).
        candidate_hidden: ``[n_candidates, H]`` last-layer hidden state at the last token of context+candidate.
            Present when a head asks for it (``Head.needs_candidate_hidden``).
        heads: the outputs of the heads run in this pass, by key (what an updater reads after ``trainer.forward``):
            a tensor, or a dict of tensors, per head.
        head_levels: each head's level ("context", "candidate" or "token"), by key.
        token_logprobs: ``[n_tokens]`` the log-prob of every scored token (differentiable in updates), flat: the
            tokens of candidate 0 in order, then those of candidate 1, ...; each candidate's sum is its
            ``candidate_scores`` entry. Present with ``per_token=True`` (:meth:`Trainer.forward`).
        token_candidate: ``[n_tokens]`` the candidate (index into ``candidate_scores``) of each token.
        token_ids: ``[n_tokens]`` the id of each scored token.
        token_entropy: ``[n_tokens]`` entropy, in nats, of the model's distribution at the position that predicts
            each scored token (differentiable in updates). Present with ``entropy=True``.
        context_hidden_layers / candidate_hidden_layers: ``{layer: [n, H]}``, the hidden states of the layers the
            pass's heads declare (``Head.hidden_layers``, indices into Hugging Face's ``hidden_states`` as
            declared, e.g. ``-1`` or ``0`` for the embeddings), at the same positions as ``context_hidden`` /
            ``candidate_hidden`` (which are the ``-1`` entries). Seq2seq: the decoder's hidden states.
        token_hidden: ``[n_tokens, H]`` last-layer hidden state at the position that *predicts* each scored token, in
            ``token_logprobs`` order: causal, the position of the token just before it (the context's last token
            for a candidate's first token, then the candidate's own tokens); seq2seq, decoder position ``t`` (which
            reads the start token and the candidate's first ``t`` tokens) for the candidate's token ``t``. Its
            logits give the token's log-prob. Present when a head asks (``Head.needs_token_hidden``).
        token_hidden_layers: ``{layer: [n_tokens, H]}``, the same for every declared layer.
        token_logits: ``[n_tokens, vocab]`` float32 logits at those same positions (``log_softmax`` of a row,
            taken at the token's id, is its ``token_logprobs`` entry). Present when a head asks
            (``Head.needs_logits``); costs ``n_tokens x vocab`` floats.
        context_logits: ``[n_contexts, vocab]`` float32 logits of the token after each context (causal: at the last
            token of the context tokenised alone, as ``model(ids).logits[:, -1]``; seq2seq: of the decoder's first
            token), whether or not the call has candidates. Present when a head asks
            (``Head.needs_context_logits``); costs ``n_contexts x vocab`` floats.
        Use :meth:`tokens_by_candidate` for padded ``[n_candidates, max_tokens]`` views of the per-token tensors.
    """

    kind: str
    num_contexts: int
    candidate_scores: torch.Tensor
    candidate_token_counts: torch.Tensor
    candidate_context: torch.Tensor
    context_hidden: torch.Tensor | None = None
    candidate_hidden: torch.Tensor | None = None
    heads: dict[str, torch.Tensor | dict[str, torch.Tensor]] | None = None  # the engine always fills both dicts
    head_levels: dict[str, str] | None = None  # "context", "candidate" or "token", per head key
    token_logprobs: torch.Tensor | None = None
    token_candidate: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None
    context_hidden_layers: dict[int, torch.Tensor] | None = None
    candidate_hidden_layers: dict[int, torch.Tensor] | None = None
    token_hidden: torch.Tensor | None = None
    token_hidden_layers: dict[int, torch.Tensor] | None = None
    token_logits: torch.Tensor | None = None
    context_logits: torch.Tensor | None = None

    def tokens_by_candidate(self, values: torch.Tensor | None = None, fill: float = 0.0
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(padded, mask)``, both ``[n_candidates, max_tokens]``: a per-token tensor (default
        ``token_logprobs``; or ``token_entropy``, ``token_ids``, or any ``[n_tokens]`` tensor of yours) laid out
        one row per candidate, its tokens in order, ``fill`` after them; ``mask`` is True on real tokens.

        Example (a token-level policy-gradient loss)::

            out = trainer.forward(contexts, candidates, per_token=True)
            logp, mask = out.tokens_by_candidate()
            loss = batch.mean(-(advantages * (logp * mask).sum(1)))
        """
        if self.token_candidate is None:
            raise ValueError("these outputs have no per-token values: call trainer.forward(..., per_token=True)")
        values = self.token_logprobs if values is None else values
        n_cand = len(self.candidate_scores)
        index = self.token_candidate.cpu()
        counts = torch.bincount(index, minlength=n_cand)
        width = int(counts.max()) if counts.numel() else 0
        padded = values.new_full((n_cand, width), fill)
        mask = torch.zeros((n_cand, width), dtype=torch.bool, device=values.device)
        if len(index):
            col = torch.arange(len(index)) - (torch.cumsum(counts, 0) - counts)[index]
            row, col = index.to(values.device), col.to(values.device)
            padded = padded.index_put((row, col), values)
            mask[row, col] = True
        elif values.is_floating_point():  # still part of the graph (a replica with no token reaches every weight)
            padded = keep_in_graph(padded, values)
        return padded, mask

    def scores_by_context(self, fill: float = float("-inf")) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, mask)``, both ``[n_contexts, max_candidates]``: padded per-context candidate scores."""
        counts = torch.bincount(self.candidate_context.cpu(), minlength=self.num_contexts)
        width = int(counts.max()) if counts.numel() else 0
        scores = self.candidate_scores.new_full((self.num_contexts, width), fill)
        mask = torch.zeros((self.num_contexts, width), dtype=torch.bool, device=scores.device)
        if self.candidate_scores.numel():
            starts = torch.cumsum(counts, 0) - counts
            ctx = self.candidate_context.cpu()
            col = torch.arange(len(ctx)) - starts[ctx]
            ctx, col = ctx.to(scores.device), col.to(scores.device)
            scores = scores.index_put((ctx, col), self.candidate_scores)
            mask[ctx, col] = True
        else:  # still part of the graph: a replica with no sample must reach the same weights as the others
            scores = keep_in_graph(scores, self.candidate_scores)
        return scores, mask


class Head(torch.nn.Module):
    """A module computing extra outputs from the LLM's forward pass (a value head, a Q-head, a classifier).

    Subclass it, set the class attributes, and implement ``__init__`` and ``forward``. The engine
    seeds the random generator identically on every replica before building heads, so heads start
    equal everywhere; they are trained with the model when an updater uses them. Parameters need at
    least one dimension (DeepSpeed cannot broadcast 0-dimensional ones): use shape ``(1,)`` for a scalar.

    A head declares what its ``forward`` reads, and only that is computed and kept (nothing more than the
    summed scores when no requested head asks): Lamorel's module functions see the same things.

    Class attributes:
        level: ``"context"`` (one output per context, e.g. a state value), ``"candidate"`` (one output per
            candidate, e.g. an action value) or ``"token"`` (one output per scored token, flat in
            ``token_logprobs`` order, e.g. a per-token value head; the client returns it cut per candidate, as
            per-token log-probs).
        needs_context_hidden / needs_candidate_hidden: the hidden states at each context's / candidate's last
            token (``outputs.context_hidden``, ``outputs.candidate_hidden``).
        needs_token_hidden: the hidden states at the position predicting each scored token
            (``outputs.token_hidden``, see :class:`ForwardOutputs` for the exact position).
        hidden_layers: which layers those hidden states are kept for: indices into Hugging Face's
            ``hidden_states`` tuple (``0``: the embeddings, ``-1``: the last layer, negative from the end; seq2seq:
            the decoder's), read as ``outputs.context_hidden_layers[i]``, ``candidate_hidden_layers[i]``,
            ``token_hidden_layers[i]``, keyed as declared. An index beyond the model's layers is refused at load.
        needs_logits: ``outputs.token_logits`` (``[n_tokens, vocab]`` float32, the logits at the positions that
            predict the scored tokens).
        needs_context_logits: ``outputs.context_logits`` (``[n_contexts, vocab]`` float32, the logits of the next
            token after each context: no candidate needed). The built-in ``next_token`` head returns them.
        args_schema: optional JSON Schema of the constructor's keyword arguments.

    Per-call keyword arguments: ``score(..., head_kwargs={...})``, ``custom_module_fns(..., head_kwargs=...)`` and
    ``trainer.forward(..., head_kwargs=...)`` pass a dict to the heads of the call; ``forward(self, outputs,
    **kwargs)`` receives all of it, a ``forward`` with named keyword parameters only those it names. On the client,
    a value with one entry per context (a list, tuple, tensor or array whose length is the number of contexts; not
    a string or dict) is sliced with the contexts, so each replica's heads see the entries of their own contexts
    in order (a context cut over several replicas gives its entry to each); other values reach every replica
    whole (as ``update`` slices its keyword arguments). ``trainer.forward`` passes them as given.

    Outputs: a tensor, or a dict of tensors, each with the level's first dimension; the client returns a dict
    under the head's key. A wrong first dimension is refused with a :class:`~llmrl.engine.errors.PluginError`
    naming the head (the servers keep serving).
    """

    level: ClassVar[str] = "context"
    needs_context_hidden: ClassVar[bool] = True
    needs_candidate_hidden: ClassVar[bool] = False
    needs_token_hidden: ClassVar[bool] = False
    needs_logits: ClassVar[bool] = False
    needs_context_logits: ClassVar[bool] = False
    hidden_layers: ClassVar[tuple[int, ...]] = (-1,)
    args_schema: ClassVar[dict | None] = None

    def __init__(self, llm: LLMInfo, **args):
        """Build the head's layers.

        Args:
            llm: the LLM's sizes, dtype and device (build layers of ``llm.hidden_size``).
            **args: the ``args`` given in the config.
        """
        super().__init__()

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor | dict[str, torch.Tensor]:
        """Compute the head's output.

        Args:
            outputs: the pass's outputs; read ``outputs.context_hidden``, ``outputs.candidate_hidden``,
                ``outputs.token_hidden``, the ``*_hidden_layers`` dicts, ``outputs.token_logits``,
                ``outputs.context_logits``.
            **kwargs: (when declared) the call's ``head_kwargs``.

        Returns:
            A tensor, or a dict of tensors, whose first dimension is ``outputs.num_contexts`` (level
            "context"), the number of candidates (level "candidate") or of scored tokens (level "token").
        """
        raise NotImplementedError


class Initializer:
    """Transforms the loaded model before the DeepSpeed engine is built: freeze layers, add LoRA
    adapters, load weights. Initializers run in config order, with the same random seed on every
    replica.

    Class attributes:
        args_schema: optional JSON Schema of the constructor's keyword arguments.
    """

    args_schema: ClassVar[dict | None] = None

    def __init__(self, **args):
        """Receive the ``args`` given in the config."""

    def initialize(self, model: torch.nn.Module, llm: LLMInfo) -> torch.nn.Module:
        """Return the model to serve (the same object modified in place, or a wrapper such as a PeftModel).

        Args:
            model: the Hugging Face model, on its device, in evaluation mode.
            llm: the LLM's description.

        Returns:
            The model to use from now on. Parameters left with ``requires_grad=True`` are trained.
        """
        raise NotImplementedError


class Updater:
    """One training step on one replica: gets this replica's share of the batch and a :class:`Trainer`.

    Every replica of the LLM runs ``update`` at once, each on its share; DeepSpeed averages the
    gradients across replicas (never across other LLMs or the client). All replicas must call
    ``trainer.backward`` and ``trainer.step`` the same number of times: iterate with
    ``batch.minibatches(...)``, which yields the same number of (possibly empty) minibatches on every
    replica, and reduce losses with ``batch.mean(...)``, which is exact across replicas.

    An updater with state of its own (a random generator, running statistics) may define
    ``state_dict()`` and ``load_state_dict(state)``; checkpoints then save and restore it.

    An updater that holds tensors of its own between updates (``ilql``'s float32 copies of half-precision target
    heads) may define ``held_bytes()``; the servers' memory report (``server_memory()``) lists it as
    ``updater_bytes``.

    An updater whose policy is not the model's plain distribution (``nlpo``'s masked policy, ``ilql``'s
    advantage-steered one) may define ``steering(self, view, **options)`` returning a Hugging Face
    ``LogitsProcessor``; ``generate(..., steer=True)`` (or a dict of ``options``) then samples from that policy
    (:class:`llmrl.plugins.steering_api.SteeringView` is ``view``: the model, heads and adapters).

    Class attributes:
        args_schema: optional JSON Schema of the constructor's keyword arguments.
        per_sample_args: the keyword arguments of ``update`` read per sample, each with its level (``"sample"``: one
            value per context; ``"candidate"``: per context, one per candidate; ``"token"``: per context, one
            sequence per candidate, one value per scored token; ``"candidate_or_token"``: per candidate either),
            e.g. ``{"rewards": "candidate"}``; the values are numbers. The client
            refuses a declared argument of the wrong shape, or holding anything but numbers (a string), before
            sending, and slices exactly these per replica
            (:mod:`llmrl.plugins.per_sample`). None keeps the length rule (an argument whose length is the number
            of contexts is sliced).
        whole_args: the other keyword arguments ``update`` reads (each replica receives them whole). A tuple (even
            empty) next to ``per_sample_args`` closes the list: the client refuses any other keyword argument by
            name, before sending (a misspelt ``old_logprob`` would otherwise be ignored without a word). None
            (the default) accepts any.
    """

    args_schema: ClassVar[dict | None] = None
    per_sample_args: ClassVar[dict[str, str] | None] = None
    whole_args: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, **args):
        """Receive the ``args`` given in the config."""

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        """Train on this replica's share of the batch.

        Args:
            batch: the contexts, candidates and per-sample keyword arguments of this replica.
            trainer: forward passes with gradients, ``backward`` and ``step`` (see :class:`Trainer`).

        Returns:
            Plain statistics (floats, ints, lists), returned to the client per replica.
        """
        raise NotImplementedError


class ShufflingUpdater(Updater):
    """An updater that shuffles its minibatches with its own seeded generator (``self.generator``), saved in
    checkpoints so that a resumed run shuffles as an uninterrupted one would. Subclasses call
    ``super().__init__(seed)`` and may extend ``state_dict`` / ``load_state_dict``."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

