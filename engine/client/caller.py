"""The client API: :class:`Caller`, which your RL script uses to reach the LLM servers of its run.

``Caller()`` finds the run rank 0 hosts (:mod:`llmrl.engine.client.hosting`), waits for every server rank, sends
them the plugins given by the script, and serves ``score``, ``custom_module_fns``, ``generate``, ``update`` (each
with an ``_async`` twin returning a future; calls to different LLMs run concurrently), the steps whose loss lives in
the script (``forward_backward``, ``optim_step``...: :mod:`llmrl.engine.client.training_calls`), snapshots and
adapters made at run time (:mod:`llmrl.engine.client.adapter_calls`), ``save``
(:mod:`llmrl.engine.client.saving`), the served tokenizer and chat messages as contexts
(:mod:`llmrl.engine.client.chat`), multi-turn episodes (:mod:`llmrl.engine.client.episodes`), experiment tracking
(``log``, ``server_memory``: :mod:`llmrl.engine.client.tracking_calls`), and ``state_dict``, ``tokenize``, ``ping``,
``servers``, ``close_llm`` and ``close``. A call to
the servers checks its arguments and hands them to its request kind (:mod:`llmrl.engine.requests`), which splits
them across the replicas of the target LLM and assembles the replies: results come back in order as CPU tensors and
plain Python.

This module computes nothing, splits nothing and writes no checkpoint itself.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Sequence
from typing import Any

from llmrl.engine.client import chat, saving
from llmrl.engine.client.adapter_calls import AdapterCalls
from llmrl.engine.client.episodes import EpisodeCalls
from llmrl.engine.client.hosting import current_run, startup_bar
from llmrl.engine.client.tracking_calls import TrackingCalls
from llmrl.engine.client.training_calls import ClientTraining
from llmrl.engine.errors import (
    InvalidArgument,
    InvalidArgumentType,
    LLMClosedError,
    RequestTimeoutError,
    did_you_mean,
)
from llmrl.engine.requests import admin, generate, inputs, score, state_dict, tokenize, update


class Caller(ClientTraining, AdapterCalls, EpisodeCalls, TrackingCalls):
    """Your script's handle on the LLM servers of this run.

    Create it once, inside a script started by ``llmrl run`` (or ``deepspeed --module llmrl.launch``).

    Args:
        heads: extra heads for the default LLM (or ``llm``): ``{"key": HeadClass}`` or ``{"key": (HeadClass, args)}``.
            Classes defined in your script work: servers import the script as a module (keep your RL
            loop under ``if __name__ == "__main__":``).
        initializers: extra initializers (classes or ``(class, args)`` pairs), applied after the config's.
        updater: the updater (class or ``(class, args)``), replacing the config's.
        llm: which LLM ``heads``/``initializers``/``updater`` are for (default: the first in the config).
        timeout: seconds a call may take before :class:`RequestTimeoutError` (default ``timeouts.request``).
        progress: show a progress bar while the servers start.
        tracking: the config's ``tracking`` keys to replace (a dict), back end names (``["csv", "tensorboard"]``),
            or False for none; each ``update``'s statistics and :meth:`log`'s scalars go there.

    Example::

        with Caller() as caller:
            logp = caller.score(["You see a door. You"], [[" open it", " leave"]])
    """

    def __new__(cls, *args, **kwargs):  # Lamorel's Caller(config, custom_updater=...) is answered with llmrl's form
        from llmrl.plugins.checks import refuse_lamorel_call
        refuse_lamorel_call(args, kwargs)
        return super().__new__(cls)

    def __init__(self, *, heads: dict | None = None, initializers: list | None = None, updater=None,
                 llm: str | None = None, timeout: float | None = None, progress: bool = True, tracking=None):
        from llmrl.plugins import registry
        from llmrl.plugins.checks import given_plugins

        if registry.importing_script:
            raise RuntimeError("Caller() was created while a server imported your script to find its plugins: "
                               "put your RL loop under `if __name__ == '__main__':` so it runs only on the client")
        given = given_plugins(heads, initializers, updater)  # instances, bad constructors, reserved keys: refused now
        run = current_run()
        if run is None:
            raise RuntimeError("Caller() runs inside an llmrl launch: start your script with "
                               "`llmrl run --config CONFIG script.py` (or deepspeed --module llmrl.launch ...)")
        if run.caller is not None:
            raise RuntimeError("this run already has a Caller; create it once and pass it around")
        self._run = run
        self.config = run.config
        self._timeout = self.config.timeouts.request if timeout is None else timeout
        self._closed = False
        self._rng = saving.generate_seeds(self.config)  # as a resumed checkpoint left it
        self._tokenizers = chat.Tokenizers(self.config)
        self._start_tracking(tracking)
        target = self._llm(llm)
        plugins: dict[str, dict[str, Any]] = {target: given} if given else {}
        bar = startup_bar(progress, len(run.roles))
        try:
            run.links.wait_connected(self.config.timeouts.startup, bar.update_to if bar else None)
            if bar:
                bar.set_description("llmrl: building engines")
            self.info: dict[str, dict] = self._wait(admin.send_setup(run, plugins, run.roles),
                                                    self.config.timeouts.startup)
        finally:
            if bar:
                bar.close()
        run.caller = self

    @property
    def llms(self) -> list[str]:
        """Names of the LLMs of this run, in config order (the first is the default)."""
        return list(self.config.llms)

    def _llm(self, llm: str | None) -> str:
        name = llm or self.config.default_llm
        if name not in self.config.llms:
            raise InvalidArgument(f"unknown llm {name!r}{did_you_mean(name, self.config.llms)}; this run serves "
                             f"{', '.join(self.config.llms)}")
        if name in self._run.closed_llms:
            serving = [n for n in self.config.llms if n not in self._run.closed_llms]
            hint = " (a call without llm= goes to the first LLM of the config)" if llm is None else ""
            raise LLMClosedError(f"LLM {name!r} was closed with close_llm(); its servers have stopped{hint}; this run "
                                 f"still serves: {', '.join(serving) or 'none'}")
        return name

    def _open(self, llm: str | None = None) -> str:
        """Check that the Caller is open and return the target LLM's name."""
        if self._closed:
            raise RuntimeError("this Caller is closed")
        return self._llm(llm)

    @property
    def tokenizer(self):
        """The first LLM's tokenizer (see :meth:`get_tokenizer`)."""
        return self.get_tokenizer()

    def get_tokenizer(self, llm: str | None = None):
        """The Hugging Face tokenizer LLM ``llm`` serves with, on the client (no model is loaded)."""
        return self._tokenizers.get(self._open(llm))

    def _inputs(self, llm: str, contexts, candidates=None, *, candidates_needed: bool = False):
        """Checked contexts (chat messages rendered) and candidates (token ids within the LLM's vocabulary)."""
        contexts, candidates = chat.render(contexts, candidates, self._tokenizers.get, llm)
        contexts = inputs.check_contexts(contexts)
        if candidates is not None or candidates_needed:
            candidates = inputs.check_candidates(candidates, contexts)
        inputs.check_vocabulary(contexts, candidates, self.info.get(llm, {}).get("vocab_size"), llm)
        return contexts, candidates

    def _head_levels(self, llm: str) -> dict[str, str]:
        """Each head's level ("context" or "candidate") on ``llm``, as its servers described them at setup."""
        return self.info[llm]["heads"]

    def _wait(self, future: concurrent.futures.Future, timeout: float | None = None):
        timeout = self._timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            busy = self._run.links.busy_ranks(future)
            self._run.links.forget(future)
            raise RequestTimeoutError(f"the request took longer than {timeout:g} s (timeouts.request); ranks still "
                                      f"working on it: {busy}") from None

    # ------------------------------------------------------------------ score & heads

    def score_async(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum",
                    normalize: bool = False, probabilities: bool = False, minibatch_size: int | None = None,
                    additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None,
                    per_token: bool = False, entropy: bool = False, add_eos: bool = False,
                    head_kwargs: dict | None = None) -> concurrent.futures.Future:
        """Like :meth:`score`, returning a future."""
        name = self._open(llm)
        if reduction not in ("sum", "mean"):
            raise InvalidArgument(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if entropy and not per_token:
            raise InvalidArgument("entropy=True needs per_token=True (entropies are given per token)")
        if head_kwargs and not additional_module_function_keys:
            raise InvalidArgument("head_kwargs were given, but no head runs in this call: name the heads in "
                                  "additional_module_function_keys=[...] (or call custom_module_fns)")
        contexts, candidates = self._inputs(name, contexts, candidates, candidates_needed=True)
        request = score.ScoreRequest(contexts, candidates, inputs.check_keys(additional_module_function_keys),
                                     peft_adapter, inputs.check_minibatch_size(minibatch_size), bool(per_token),
                                     bool(entropy), bool(add_eos),
                                     inputs.check_head_kwargs(head_kwargs))
        return score.send(self._run, name, request,
                          score.Finish(reduction, normalize, probabilities, per_token=bool(per_token)),
                          self._head_levels(name))

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
        return self._wait(self.score_async(
            contexts, candidates, llm=llm, reduction=reduction, normalize=normalize, probabilities=probabilities,
            minibatch_size=minibatch_size, additional_module_function_keys=additional_module_function_keys,
            peft_adapter=peft_adapter, per_token=per_token, entropy=entropy, add_eos=add_eos, head_kwargs=head_kwargs))

    def custom_module_fns_async(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                                peft_adapter: str | None = None, minibatch_size: int | None = None,
                                add_eos: bool = False, head_kwargs: dict | None = None) -> concurrent.futures.Future:
        """Like :meth:`custom_module_fns`, returning a future."""
        name = self._open(llm)
        keys = inputs.check_keys(keys)
        if not keys:
            raise InvalidArgument("custom_module_fns needs at least one head key")
        contexts, candidates = self._inputs(name, contexts, candidates)
        request = score.ScoreRequest(contexts, candidates, keys, peft_adapter, inputs.check_minibatch_size(
            minibatch_size), add_eos=bool(add_eos), head_kwargs=inputs.check_head_kwargs(head_kwargs))
        return score.send(self._run, name, request, score.Finish(scores=False), self._head_levels(name))

    def custom_module_fns(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                          peft_adapter: str | None = None, minibatch_size: int | None = None,
                          add_eos: bool = False, head_kwargs: dict | None = None) -> list[dict]:
        """Run heads on contexts (and candidates), strings or token ids as in :meth:`score`. Returns one
        ``{key: output}`` dict per context (context-level heads give one output per context, candidate-level heads
        one row per candidate, token-level heads a list with one tensor per candidate; a head returning a dict
        gives a dict of those). ``head_kwargs`` go to the heads' ``forward``, as in :meth:`score`."""
        return self._wait(self.custom_module_fns_async(keys, contexts, candidates, llm=llm, peft_adapter=peft_adapter,
                                                       minibatch_size=minibatch_size, add_eos=add_eos,
                                                       head_kwargs=head_kwargs))

    # ------------------------------------------------------------------ generate

    def generate_async(self, contexts, *, llm: str | None = None, peft_adapter: str | None = None,
                       seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs
                       ) -> concurrent.futures.Future:
        """Like :meth:`generate`, returning a future."""
        name = self._open(llm)
        seed = self._rng.randrange(2**31) if seed is None else inputs.check_seed(seed)
        request = generate.GenerateRequest(self._inputs(name, contexts)[0], generate_kwargs, peft_adapter, seed,
                                           inputs.check_minibatch_size(minibatch_size))
        return generate.send(self._run, name, request)

    def generate(self, contexts, *, llm: str | None = None, peft_adapter: str | None = None, seed: int | None = None,
                 minibatch_size: int | None = None, **generate_kwargs) -> list[list[dict]]:
        """Generate continuations with Hugging Face ``generate`` (any of its keyword arguments: ``temperature``,
        ``top_k``, ``top_p``, ...; ``seed`` makes a call reproducible). Contexts are strings (tokenised as :meth:`score`
        tokenises contexts), lists of token ids used as given, or chat messages (as in :meth:`score`). ``stop``:
        strings (matched as Hugging Face's ``stop_strings``) and/or token ids or id lists; ``prompt_logprobs=True``
        adds the prompts' log-probs.

        Returns:
            Per context, ``num_return_sequences`` dicts with ``text``, ``tokens`` (the generated ids, up to and
            including EOS or the stop), ``logprobs`` (each token's raw model log-prob: they agree with ``score``),
            ``sampling_logprobs`` (greedy and sampling: the log-prob under the distribution the token was drawn
            from, after temperature / top-k / top-p; the denominator of an importance ratio against the sampler),
            ``logprob`` (their sum), ``stop_reason`` (``"stop"``: EOS or a stop; ``"length"``: ``max_new_tokens``)
            and ``stop`` (the stop string or ids that matched, else None); ``prompt_logprobs`` on request (each
            prompt token's but the first), and with ``num_beams > 1`` ``beam_score`` (Hugging Face's
            ``sequences_scores``).
        """
        return self._wait(self.generate_async(contexts, llm=llm, peft_adapter=peft_adapter, seed=seed,
                                              minibatch_size=minibatch_size, **generate_kwargs))

    # ------------------------------------------------------------------ update

    def update_async(self, contexts, candidates=None, *, llm: str | None = None, **kwargs
                     ) -> concurrent.futures.Future:
        """Like :meth:`update`, returning a future."""
        name = self._open(llm)
        contexts, candidates = self._inputs(name, contexts, candidates)
        info = self.info.get(name, {})
        return update.send(self._run, name, contexts, candidates, kwargs, info.get("per_sample"),
                           info.get("updater") or "", info.get("whole_args"))

    def update(self, contexts, candidates=None, *, llm: str | None = None, **kwargs) -> list[dict]:
        """Run the LLM's updater on every replica, each on its share of the batch. Contexts and candidates are
        strings or token ids as in :meth:`score`; the updater receives them as given (token ids as lists of ints)
        and may pass them to ``trainer.forward``.

        The updater's declared per-sample arguments (``Updater.per_sample_args``) are checked against the call and
        sliced like the contexts; for an updater that declares none, arguments whose length equals the number of
        contexts are. The others reach every replica whole. NaN or infinite numbers anywhere are refused.

        Returns:
            The updater's statistics, one dict per replica (also written by the run's tracking, see :meth:`log`).
        """
        return self._tracked(llm, contexts, lambda: self.update_async(contexts, candidates, llm=llm, **kwargs))

    # ------------------------------------------------------------------ checkpoints & misc

    def save(self, path: str | os.PathLike) -> str:
        """Write a checkpoint of every LLM to ``path`` atomically (see :mod:`llmrl.engine.client.saving`)."""
        self._open()
        if self._run.closed_llms:
            raise LLMClosedError(f"cannot save: LLM(s) {sorted(self._run.closed_llms)} were closed with close_llm(), "
                                 "and a checkpoint holds every LLM of the run; save before closing an LLM")
        return saving.save_run(self._run, self._wait, os.fspath(path), self._rng, self.tracker.position())

    def state_dict(self, llm: str | None = None, prefix: str = "", replica: int | None = None) -> dict:
        """The LLM's full weights (model, adapters and heads; ZeRO-3 and tensor-parallel shards gathered) as CPU
        tensors, keyed like ``model.<hf name>`` and ``heads.<key>.<name>``; ``prefix`` selects a subset.
        ``replica=k`` returns replica k's own copy instead (ZeRO 0-2 without tensor parallelism)."""
        return self._wait(state_dict.send(self._run, self._open(llm), prefix, replica))

    def tokenize(self, contexts, candidates=None, *, llm: str | None = None) -> list[dict]:
        """How ``score`` tokenises these inputs: per context ``ids`` and ``tokens``, and per candidate the ``ids`` /
        ``tokens`` whose log-probs are summed and ``merged_context_tokens`` (how many of the context's last tokens
        merged with the candidate's first characters, as tokenising the concatenation does)."""
        name = self._open(llm)
        contexts, candidates = self._inputs(name, contexts, candidates)
        return self._wait(tokenize.send(self._run, name, tokenize.TokenizeRequest(contexts, candidates)))

    def ping(self, rank: int | None = None) -> float:
        """Round-trip time in seconds of a minimal request to one server rank (default: the first)."""
        self._open()
        rank = self._run.ping_target(rank)
        start = time.perf_counter()
        self._wait(admin.send_ping(self._run, rank))
        return time.perf_counter() - start

    def servers(self) -> dict[int, dict]:
        """Every server rank: its LLM, replica, tensor-parallel rank, host, pid, and whether its LLM was closed."""
        return {rank: {"llm": h.llm, "replica": h.replica, "tp_rank": h.tp_rank, "host": h.host, "pid": h.pid,
                       "closed": h.llm in self._run.closed_llms}
                for rank, h in sorted(self._run.links.hellos.items())}

    def close_llm(self, llm: str) -> None:
        """Stop one LLM's servers cleanly while the run's other LLMs go on serving (free its memory once it is no
        longer needed: a reward model after scoring, a reference policy).

        Calls already sent to it are answered first; this returns when its ranks have exited (code 0: the run
        still ends cleanly). Later calls naming it raise :class:`~llmrl.engine.errors.LLMClosedError`, and so does
        ``save`` (a checkpoint holds every LLM). Closing an LLM twice does nothing.

        Raises:
            InvalidArgument: ``llm`` is not an LLM of this run.
            ServerDiedError: one of its ranks died instead of stopping.
        """
        if self._closed:
            raise RuntimeError("this Caller is closed")
        if not isinstance(llm, str):
            raise InvalidArgumentType(f"close_llm needs the name of an LLM (one of {', '.join(self.config.llms)}), "
                                      f"got {type(llm).__name__}")
        if llm in self._run.closed_llms:
            return
        name = self._llm(llm)
        try:
            self._run.close_llm(name, self._timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"LLM {name!r} did not stop within {self._timeout:g} s (timeouts.request)"
                                      ) from None

    def close(self) -> None:
        """Stop every server cleanly (they exit 0). Further calls raise."""
        if self._closed:
            return
        self._closed = True
        self._close_tracking(quiet=True)
        self._run.shutdown(abort=False, reason="Caller.close()")

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self._close_tracking(quiet=True)
            self._run.shutdown(abort=True, reason=f"the script raised {exc_type.__name__}")

