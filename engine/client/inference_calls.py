"""The Caller's calls that run the served model without training it: ``score`` and ``custom_module_fns`` (heads),
``generate``, ``tokenize`` and ``state_dict``, each ``*_async`` twin returning a future.

:class:`InferenceCalls` is a part of :class:`~llmrl.engine.client.caller.Caller`; it checks a call's arguments and
hands them to its request kind (``score``, ``generate``, ``tokenize``, ``state_dict``), which splits them across the
replicas of the target LLM and assembles the replies. This module computes nothing on the model and changes no
weight.
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Sequence

from llmrl.engine.client.call_context import CallContext
from llmrl.engine.errors import InvalidArgument
from llmrl.engine.requests import generate, inputs, score, state_dict, tokenize


class InferenceCalls:
    """``score``, ``custom_module_fns``, ``generate`` (and their futures), ``tokenize`` and ``state_dict``.

    Args:
        context: the Caller's shared run, config and wait.
        seeds: the generator of the seeds of ``generate`` calls made without one (a checkpoint saves its state).
    """

    def __init__(self, context: CallContext, seeds: random.Random):
        self._context = context
        self._seeds = seeds

    def score_async(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum",
                    normalize: bool = False, probabilities: bool = False, minibatch_size: int | None = None,
                    additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None,
                    per_token: bool = False, entropy: bool = False, add_eos: bool = False,
                    head_kwargs: dict | None = None) -> concurrent.futures.Future:
        """Like :meth:`score`, returning a future."""
        name = self._context.open(llm)
        if reduction not in ("sum", "mean"):
            raise InvalidArgument(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if entropy and not per_token:
            raise InvalidArgument("entropy=True needs per_token=True (entropies are given per token)")
        if head_kwargs and not additional_module_function_keys:
            raise InvalidArgument("head_kwargs were given, but no head runs in this call: name the heads in "
                                  "additional_module_function_keys=[...] (or call custom_module_fns)")
        contexts, candidates = self._context.inputs(name, contexts, candidates, candidates_needed=True)
        request = score.ScoreRequest(contexts, candidates, inputs.check_keys(additional_module_function_keys),
                                     peft_adapter, inputs.check_minibatch_size(minibatch_size), bool(per_token),
                                     bool(entropy), bool(add_eos),
                                     inputs.check_head_kwargs(head_kwargs))
        return score.send(self._context.run, name, request,
                          score.Finish(reduction, normalize, probabilities, per_token=bool(per_token)),
                          self._context.head_levels(name))

    def score(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum", normalize: bool = False,
              probabilities: bool = False, minibatch_size: int | None = None,
              additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None,
              per_token: bool = False, entropy: bool = False, add_eos: bool = False, head_kwargs: dict | None = None):
        """Log-probability of each candidate given its context.

        Args:
            contexts: N prompts: strings, lists of token ids (a list of ints, or a 1-D integer tensor such as a
                ``generate`` sample's ``tokens``) used exactly as given: no BOS added, no re-tokenisation, or lists
                of chat messages (rendered with the chat template and its generation prompt; string candidates).
            candidates: N lists of candidate continuations (a list may be empty): strings, or lists of token ids,
                which are exactly the tokens scored, after the whole context (no boundary merge). A context given
                as ids takes candidates given as ids.
            llm: which LLM (default: the first of the config).
            reduction: ``"sum"`` of the candidate tokens' log-probs (log p(candidate | context)), or ``"mean"``.
            normalize: log-softmax over each context's candidates (the log-policy over the offered actions).
            probabilities: return exp of the result.
            minibatch_size: most rows per forward pass (default: the LLM's ``minibatch_size``).
            additional_module_function_keys: heads to run in the same forward pass.
            head_kwargs: keyword arguments for those heads' ``forward`` (Lamorel's module-function kwargs): values
                with one entry per context are sliced with the contexts, others reach every replica whole.
            peft_adapter: the LoRA adapter to use.
            per_token: also return each candidate's scored tokens and their log-probs.
            entropy: with ``per_token``, also the entropy (nats) of the model's distribution at each scored position.
            add_eos: every candidate's tokens end with the tokenizer's EOS token (appended unless the tokenizer
                already ends them with it), scored as well (Lamorel's ``add_eos_on_candidates``).

        Returns:
            One 1-D float tensor per context (empty for an empty candidate list); with
            ``additional_module_function_keys``, one dict per context with ``"score"`` and each head's output (a
            tensor, or a dict of tensors; a token-level head's output is cut per candidate: a list of tensors).
            With ``per_token``, one dict per context: ``"score"`` (as without), ``"tokens"`` (per candidate, a
            LongTensor of its scored token ids), ``"logprobs"`` (per candidate, each token's raw log-prob; they sum
            to the ``"sum"`` score, before ``normalize``), ``"entropy"`` with ``entropy=True`` (per candidate), and
            each head's output.

        Example::

            sample = caller.generate([prompt], do_sample=True)[0][0]
            (out,) = caller.score([prompt], [[sample["tokens"]]], per_token=True)
            out["logprobs"][0]        # equals sample["logprobs"] (the same tokens, never re-tokenised)
        """
        return self._context.wait(self.score_async(
            contexts, candidates, llm=llm, reduction=reduction, normalize=normalize, probabilities=probabilities,
            minibatch_size=minibatch_size, additional_module_function_keys=additional_module_function_keys,
            peft_adapter=peft_adapter, per_token=per_token, entropy=entropy, add_eos=add_eos, head_kwargs=head_kwargs))

    def custom_module_fns_async(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                                peft_adapter: str | None = None, minibatch_size: int | None = None,
                                add_eos: bool = False, head_kwargs: dict | None = None) -> concurrent.futures.Future:
        """Like :meth:`custom_module_fns`, returning a future."""
        name = self._context.open(llm)
        keys = inputs.check_keys(keys)
        if not keys:
            raise InvalidArgument("custom_module_fns needs at least one head key")
        contexts, candidates = self._context.inputs(name, contexts, candidates)
        request = score.ScoreRequest(contexts, candidates, keys, peft_adapter, inputs.check_minibatch_size(
            minibatch_size), add_eos=bool(add_eos), head_kwargs=inputs.check_head_kwargs(head_kwargs))
        return score.send(self._context.run, name, request, score.Finish(scores=False), self._context.head_levels(name))

    def custom_module_fns(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                          peft_adapter: str | None = None, minibatch_size: int | None = None,
                          add_eos: bool = False, head_kwargs: dict | None = None) -> list[dict]:
        """Run heads on contexts (and candidates), strings or token ids as in :meth:`score`. Returns one
        ``{key: output}`` dict per context (context-level heads give one output per context, candidate-level heads
        one row per candidate, token-level heads a list with one tensor per candidate; a head returning a dict
        gives a dict of those). ``head_kwargs`` go to the heads' ``forward``, as in :meth:`score`."""
        return self._context.wait(self.custom_module_fns_async(keys, contexts, candidates, llm=llm,
                                                               peft_adapter=peft_adapter, minibatch_size=minibatch_size,
                                                               add_eos=add_eos, head_kwargs=head_kwargs))

    def generate_async(self, contexts, *, llm: str | None = None, peft_adapter: str | list[str] | None = None,
                       seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs
                       ) -> concurrent.futures.Future:
        """Like :meth:`generate`, returning a future."""
        name = self._context.open(llm)
        seed = self._seeds.randrange(2**31) if seed is None else inputs.check_seed(seed)
        request = generate.GenerateRequest(self._context.inputs(name, contexts)[0], generate_kwargs, peft_adapter,
                                           seed, inputs.check_minibatch_size(minibatch_size))
        return generate.send(self._context.run, name, request)

    def generate(self, contexts, *, llm: str | None = None, peft_adapter: str | list[str] | None = None,
                 seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs) -> list[list[dict]]:
        """Generate continuations with Hugging Face ``generate`` (any of its keyword arguments: ``temperature``,
        ``top_k``, ``top_p``, ...; ``seed`` makes a call reproducible). Contexts are strings (tokenised as :meth:`score`
        tokenises contexts), lists of token ids used as given, or chat messages (as in :meth:`score`). ``stop``:
        strings (matched as Hugging Face's ``stop_strings``) and/or token ids or id lists; ``prompt_logprobs=True``
        adds the prompts' log-probs.

        ``peft_adapter``: the LoRA adapter or snapshot every prompt reads (None: the active adapter), or a list of one
        name per context. Prompts naming different adapters then run in the same batches, each row on its own
        adapter (multi-LoRA batching: the base model's pass is shared, as when several tenants or the runs of a sweep
        sample from one served model); each sample's ``policy`` says which it read. Such a call decodes with the
        adapters unmerged, without the cache across calls, and takes a weight sync sent in flight only once it ends;
        not with ``steer``, nor naming a weight snapshot of a model without LoRA, nor under ZeRO-3 with replicas
        whose weights exceed ``training.zero3_gather_mb`` (refused, naming it).

        Returns:
            Per context, ``num_return_sequences`` dicts with ``text``, ``tokens`` (the generated ids, up to and
            including EOS or the stop), ``logprobs`` (each token's raw model log-prob: they agree with ``score``),
            ``sampling_logprobs`` (greedy and sampling: the log-prob under the distribution the token was drawn
            from, after temperature / top-k / top-p; the denominator of an importance ratio against the sampler),
            ``logprob`` (their sum), ``stop_reason`` (``"stop"``: EOS or a stop; ``"length"``: ``max_new_tokens``),
            ``stop`` (the stop string or ids that matched, else None), ``policy_version`` (the optimizer steps the
            weights it was drawn from had taken: the adapter's, a snapshot's source's when it was taken, or the
            model's without adapters) and ``policy`` (that adapter or snapshot, None without adapters);
            ``prompt_logprobs`` on request (each prompt token's but the first), and with ``num_beams > 1``
            ``beam_score`` (Hugging Face's ``sequences_scores``).
        """
        return self._context.wait(self.generate_async(contexts, llm=llm, peft_adapter=peft_adapter, seed=seed,
                                                      minibatch_size=minibatch_size, **generate_kwargs))

    def state_dict(self, llm: str | None = None, prefix: str = "", replica: int | None = None) -> dict:
        """The LLM's full weights (model, adapters and heads; ZeRO-3 and tensor-parallel shards gathered) as CPU
        tensors, keyed like ``model.<hf name>`` and ``heads.<key>.<name>``; ``prefix`` selects a subset.
        ``replica=k`` returns replica k's own copy instead (ZeRO 0-2 without tensor parallelism)."""
        return self._context.wait(state_dict.send(self._context.run, self._context.open(llm), prefix, replica))

    def tokenize(self, contexts, candidates=None, *, llm: str | None = None) -> list[dict]:
        """How ``score`` tokenises these inputs: per context ``ids`` and ``tokens``, and per candidate the ``ids`` /
        ``tokens`` whose log-probs are summed and ``merged_context_tokens`` (how many of the context's last tokens
        merged with the candidate's first characters, as tokenising the concatenation does)."""
        name = self._context.open(llm)
        contexts, candidates = self._context.inputs(name, contexts, candidates)
        request = tokenize.TokenizeRequest(contexts, candidates)
        return self._context.wait(tokenize.send(self._context.run, name, request))
