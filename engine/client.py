"""The client API: :class:`Caller`, which your RL script uses to reach the LLM servers of its run.

Rank 0 runs your script. Before the script starts, :class:`ClientRun` hosts the run's store and
listener; the servers connect to it while they load their models. ``Caller()`` waits for them,
sends them the plugins given by the script, and then serves ``score``, ``generate``,
``custom_module_fns``, ``update`` and ``save``. Each call is split across the replicas of the target
LLM (each rank receives only its share), results come back in order as CPU tensors and plain Python,
and every call has an ``_async`` twin returning a future, so the script can step its environments
while the servers compute. Calls to different LLMs run concurrently.

This module does not compute anything; it splits, sends, waits and assembles.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from llmrl.engine import protocol, rendezvous
from llmrl.engine.config import Config, PluginSpec
from llmrl.engine.errors import RequestTimeoutError
from llmrl.engine.links import ServerLinks
from llmrl.engine.topology import replica_ranks, server_roles

_current_run: ClientRun | None = None


class ClientRun:
    """Rank 0's side of a run: the store, the listener, and the links to every server rank."""

    def __init__(self, config: Config):
        self.config = config
        master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(os.environ.get("MASTER_PORT", "29500"))
        timeout = config.timeouts.startup
        self.store = rendezvous.host_run_store(master_addr, master_port, timeout)
        self.listener = rendezvous.listen(master_addr)
        host, port = self.listener.getsockname()[:2]
        token = secrets.token_bytes(32)
        self.store.set(rendezvous.TOKEN_KEY, token)
        self.store.set(rendezvous.CLIENT_ADDRESS_KEY, rendezvous.format_address(host, port))
        self.roles = {r.global_rank: r for r in server_roles(config)}
        self.links = ServerLinks(self.listener, token, sorted(self.roles), config.timeouts.heartbeat,
                                 config.timeouts.dead_after, self.describe_rank)
        self.caller: Caller | None = None

    def describe_rank(self, rank: int) -> str:
        role = self.roles.get(rank)
        if role is None:
            return f"rank {rank}"
        hello = self.links.hellos.get(rank)
        where = f" on {hello.host}, pid {hello.pid}" if hello else ""
        return f"rank {rank} (LLM {role.llm!r}, replica {role.replica}, tensor-parallel rank {role.tp_rank}{where})"

    def shutdown(self, abort: bool, reason: str) -> None:
        self.links.shutdown(abort=abort, reason=reason)


def current_run() -> ClientRun | None:
    return _current_run


def set_current_run(run: ClientRun | None) -> None:
    global _current_run
    _current_run = run


# ----------------------------------------------------------------------------- input checks


def _check_contexts(contexts) -> list[str]:
    if isinstance(contexts, str) or not isinstance(contexts, Sequence):
        raise TypeError(f"contexts must be a list of strings, got {type(contexts).__name__}")
    contexts = list(contexts)
    for i, c in enumerate(contexts):
        if not isinstance(c, str):
            raise TypeError(f"contexts[{i}] must be a string, got {type(c).__name__}")
    return contexts


def _check_candidates(candidates, n: int) -> list[list[str]]:
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise TypeError(f"candidates must be a list (one list of strings per context), got {type(candidates).__name__}")
    if len(candidates) != n:
        raise ValueError(f"got {n} contexts but {len(candidates)} candidate lists; give one list per context")
    out = []
    for i, cands in enumerate(candidates):
        if isinstance(cands, str) or not isinstance(cands, Sequence):
            raise TypeError(f"candidates[{i}] must be a list of strings, got {type(cands).__name__}")
        for j, c in enumerate(cands):
            if not isinstance(c, str):
                raise TypeError(f"candidates[{i}][{j}] must be a string, got {type(c).__name__}")
        out.append(list(cands))
    return out


def _slice(value, start: int, stop: int):
    return value[start:stop]


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def split_by_cost(costs: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges with roughly equal total cost (each context stays whole)."""
    total = sum(costs)
    bounds, start, acc = [], 0, 0
    for r in range(parts - 1):
        target = total * (r + 1) / parts
        stop = start
        while stop < len(costs) and acc + costs[stop] / 2 <= target:
            acc += costs[stop]
            stop += 1
        bounds.append((start, stop))
        start = stop
    bounds.append((start, len(costs)))
    return bounds


def _plugin_ref(obj, kind: str) -> PluginSpec:
    """A plugin given by the script: a class, a (class, args) pair, or a name string."""
    if isinstance(obj, PluginSpec):
        return obj
    args: dict = {}
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], dict):
        obj, args = obj
    if isinstance(obj, str):
        return PluginSpec(obj, dict(args))
    if isinstance(obj, type):
        module = obj.__module__
        return PluginSpec(f"{module}:{obj.__qualname__}", dict(args))
    raise TypeError(f"{kind} must be a class, a (class, args) pair or a plugin name, got {type(obj).__name__}")


# ----------------------------------------------------------------------------- the API


class Caller:
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

    Example::

        with Caller() as caller:
            logp = caller.score(["You see a door. You"], [[" open it", " leave"]])
    """

    def __init__(self, *, heads: dict | None = None, initializers: list | None = None, updater=None,
                 llm: str | None = None, timeout: float | None = None, progress: bool = True):
        from llmrl.plugins import registry

        if registry.importing_script:
            raise RuntimeError("Caller() was created while a server imported your script to find its plugins: "
                               "put your RL loop under `if __name__ == '__main__':` so it runs only on the client")
        run = current_run()
        if run is None:
            raise RuntimeError("Caller() runs inside an llmrl launch: start your script with "
                               "`llmrl run --config CONFIG script.py` (or deepspeed --module llmrl.launch ...)")
        if run.caller is not None:
            raise RuntimeError("this run already has a Caller; create it once and pass it around")
        self._run = run
        self.config = run.config
        self._links = run.links
        self._timeout = self.config.timeouts.request if timeout is None else timeout
        self._closed = False
        self._rng = random.Random(self.config.seed)
        target = llm or self.config.default_llm
        self._check_llm(target)
        plugins: dict[str, dict[str, Any]] = {}
        if heads or initializers or updater:
            plugins[target] = {
                "heads": {k: _plugin_ref(v, "head") for k, v in (heads or {}).items()},
                "initializers": [_plugin_ref(v, "initializer") for v in (initializers or [])],
                "updater": _plugin_ref(updater, "updater") if updater else None,
            }
        bar = _startup_bar(progress, len(run.roles))
        try:
            self._links.wait_connected(self.config.timeouts.startup, bar.update_to if bar else None)
            if bar:
                bar.set_description("llmrl: building engines")
            every = sorted(run.roles)
            future = self._links.submit(protocol.SETUP, [(every, {"plugins": plugins})],
                                        lambda values: {run.roles[r].llm: v for r, v in values.items() if v is not None})
            self.info: dict[str, dict] = self._wait(future, self.config.timeouts.startup)
        finally:
            if bar:
                bar.close()
        run.caller = self

    # ------------------------------------------------------------------ helpers

    @property
    def llms(self) -> list[str]:
        """Names of the LLMs of this run, in config order (the first is the default)."""
        return list(self.config.llms)

    def _check_llm(self, llm: str | None) -> str:
        name = llm or self.config.default_llm
        if name not in self.config.llms:
            import difflib

            close = difflib.get_close_matches(name, list(self.config.llms), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown llm {name!r}{hint}; this run serves {', '.join(self.config.llms)}")
        return name

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Caller is closed")

    def _wait(self, future: concurrent.futures.Future, timeout: float | None = None):
        timeout = self._timeout if timeout is None else timeout
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            busy = self._links.busy_ranks(future)
            self._links.forget(future)
            raise RequestTimeoutError(f"the request took longer than {timeout:g} s (timeouts.request); ranks still "
                                      f"working on it: {busy}") from None

    def _replicas(self, llm: str) -> list[list[int]]:
        return replica_ranks(self.config, llm)

    def _lockstep(self, llm: str) -> bool:
        cfg = self.config.llms[llm]
        return cfg.training.zero_stage == 3 and cfg.replicas > 1

    def _parts(self, llm: str, bounds: list[tuple[int, int]], make_payload, keep_empty: bool):
        parts, order = [], []
        for ranks, (start, stop) in zip(self._replicas(llm), bounds):
            if stop > start or keep_empty:
                parts.append((ranks, make_payload(start, stop)))
                order.append(ranks[0])
        return parts, order

    # ------------------------------------------------------------------ score & heads

    def score_async(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum",
                    normalize: bool = False, probabilities: bool = False, minibatch_size: int | None = None,
                    additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None
                    ) -> concurrent.futures.Future:
        """Like :meth:`score`, returning a future."""
        self._check_open()
        name = self._check_llm(llm)
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        contexts = _check_contexts(contexts)
        candidates = _check_candidates(candidates, len(contexts))
        keys = _check_keys(additional_module_function_keys)
        return self._forward_async(name, contexts, candidates, keys, peft_adapter, minibatch_size,
                                   _Finish(reduction, normalize, probabilities, keys, scores=True))

    def score(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum", normalize: bool = False,
              probabilities: bool = False, minibatch_size: int | None = None,
              additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None):
        """Log-probability of each candidate given its context.

        Args:
            contexts: N prompts.
            candidates: N lists of candidate continuations (a list may be empty).
            llm: which LLM (default: the first of the config).
            reduction: ``"sum"`` of the candidate tokens' log-probs (log p(candidate | context)), or ``"mean"``.
            normalize: log-softmax over each context's candidates (the log-policy over the offered actions).
            probabilities: return exp of the result.
            minibatch_size: most rows per forward pass (default: the LLM's ``minibatch_size``).
            additional_module_function_keys: heads to run in the same forward pass.
            peft_adapter: the LoRA adapter to use.

        Returns:
            One 1-D float tensor per context (empty for an empty candidate list); with
            ``additional_module_function_keys``, one dict per context with ``"score"`` and each head's output.
        """
        return self._wait(self.score_async(
            contexts, candidates, llm=llm, reduction=reduction, normalize=normalize, probabilities=probabilities,
            minibatch_size=minibatch_size, additional_module_function_keys=additional_module_function_keys,
            peft_adapter=peft_adapter))

    def custom_module_fns_async(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                                peft_adapter: str | None = None, minibatch_size: int | None = None
                                ) -> concurrent.futures.Future:
        """Like :meth:`custom_module_fns`, returning a future."""
        self._check_open()
        name = self._check_llm(llm)
        keys = _check_keys(keys)
        if not keys:
            raise ValueError("custom_module_fns needs at least one head key")
        contexts = _check_contexts(contexts)
        if candidates is not None:
            candidates = _check_candidates(candidates, len(contexts))
        return self._forward_async(name, contexts, candidates, keys, peft_adapter, minibatch_size,
                                   _Finish("sum", False, False, keys, scores=False))

    def custom_module_fns(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                          peft_adapter: str | None = None, minibatch_size: int | None = None) -> list[dict]:
        """Run heads on contexts (and candidates). Returns one ``{key: tensor}`` dict per context
        (context-level heads give one output per context, candidate-level heads one row per candidate)."""
        return self._wait(self.custom_module_fns_async(keys, contexts, candidates, llm=llm,
                                                       peft_adapter=peft_adapter, minibatch_size=minibatch_size))

    def _forward_async(self, llm, contexts, candidates, keys, adapter, minibatch_size, finish):
        costs = [len(c) + (sum(len(x) + len(c) // 8 for x in candidates[i]) if candidates else 0)
                 for i, c in enumerate(contexts)]
        bounds = split_by_cost(costs, len(self._replicas(llm)))

        def payload(start, stop):
            return {"contexts": contexts[start:stop], "candidates": None if candidates is None else candidates[start:stop],
                    "heads": list(keys), "peft_adapter": adapter, "minibatch_size": minibatch_size}

        parts, order = self._parts(llm, bounds, payload, keep_empty=self._lockstep(llm))
        return self._links.submit(protocol.SCORE, parts,
                                  lambda values: finish([e for leader in order for e in values[leader]]))

    # ------------------------------------------------------------------ generate

    def generate_async(self, contexts, *, llm: str | None = None, peft_adapter: str | None = None,
                       seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs
                       ) -> concurrent.futures.Future:
        """Like :meth:`generate`, returning a future."""
        self._check_open()
        name = self._check_llm(llm)
        contexts = _check_contexts(contexts)
        base_seed = self._rng.randrange(2**31) if seed is None else int(seed)
        bounds = split_evenly(len(contexts), len(self._replicas(name)))

        def payload(start, stop):
            return {"contexts": contexts[start:stop], "kwargs": generate_kwargs, "peft_adapter": peft_adapter,
                    "seed": base_seed + start, "minibatch_size": minibatch_size}

        parts, order = self._parts(name, bounds, payload, keep_empty=self._lockstep(name))
        return self._links.submit(protocol.GENERATE, parts,
                                  lambda values: [_finish_generation(g) for leader in order for g in values[leader]])

    def generate(self, contexts, *, llm: str | None = None, peft_adapter: str | None = None, seed: int | None = None,
                 minibatch_size: int | None = None, **generate_kwargs) -> list[list[dict]]:
        """Generate continuations with Hugging Face ``generate`` (any of its keyword arguments).

        Returns:
            Per context, ``num_return_sequences`` dicts with ``text``, ``tokens`` (the generated ids, up to and
            including EOS), ``logprobs`` (each token's log-prob under the raw model distribution, so they agree
            with ``score``) and ``logprob`` (their sum).
        """
        return self._wait(self.generate_async(contexts, llm=llm, peft_adapter=peft_adapter, seed=seed,
                                              minibatch_size=minibatch_size, **generate_kwargs))

    # ------------------------------------------------------------------ update

    def update_async(self, contexts, candidates=None, *, llm: str | None = None, **kwargs
                     ) -> concurrent.futures.Future:
        """Like :meth:`update`, returning a future."""
        self._check_open()
        name = self._check_llm(llm)
        contexts = _check_contexts(contexts)
        if candidates is not None:
            candidates = _check_candidates(candidates, len(contexts))
        n = len(contexts)
        bounds = split_evenly(n, len(self._replicas(name)))
        sizes = [stop - start for start, stop in bounds]

        def payload(start, stop):
            sliced = {k: (_slice(v, start, stop) if protocol.is_per_sample(v, n) else v) for k, v in kwargs.items()}
            return {"contexts": contexts[start:stop], "candidates": None if candidates is None else candidates[start:stop],
                    "kwargs": sliced, "indices": list(range(start, stop)), "global_size": n, "replica_sizes": sizes}

        parts, order = self._parts(name, bounds, payload, keep_empty=True)
        return self._links.submit(protocol.UPDATE, parts, lambda values: [values[leader] for leader in order])

    def update(self, contexts, candidates=None, *, llm: str | None = None, **kwargs) -> list[dict]:
        """Run the LLM's updater on every replica, each on its share of the batch.

        Keyword arguments whose length equals the number of contexts (lists, tensors, arrays) are
        per-sample and sliced like the contexts; the others reach every replica whole.

        Returns:
            The updater's statistics, one dict per replica.
        """
        return self._wait(self.update_async(contexts, candidates, llm=llm, **kwargs))

    # ------------------------------------------------------------------ checkpoints & misc

    def save(self, path: str | os.PathLike) -> str:
        """Write a checkpoint of every LLM to ``path`` atomically (see :mod:`llmrl.engine.checkpoint`)."""
        from llmrl.engine.checkpoint import save_run

        self._check_open()
        return save_run(self, os.fspath(path))

    def state_dict(self, llm: str | None = None, prefix: str = "", replica: int | None = None) -> dict:
        """The LLM's full weights (model, adapters and heads; ZeRO-3 and tensor-parallel shards gathered) as CPU
        tensors, keyed like ``model.<hf name>`` and ``heads.<key>.<name>``; ``prefix`` selects a subset.
        ``replica=k`` returns replica k's own copy instead (ZeRO 0-2 without tensor parallelism)."""
        self._check_open()
        name = self._check_llm(llm)
        replicas = self._replicas(name)
        ranks = [r for group in replicas for r in group] if replica is None else replicas[replica]
        payload = {"prefix": prefix, "replica": replica}
        return self._wait(self._links.submit(protocol.STATE_DICT, [(ranks, payload)], lambda values: values[ranks[0]]))

    def ping(self, rank: int | None = None) -> float:
        """Round-trip time in seconds of a minimal request to one server rank (default: the first)."""
        import time

        self._check_open()
        rank = rank or min(self._run.roles)
        start = time.perf_counter()
        self._wait(self._links.submit(protocol.PING, [([rank], {})], lambda v: v[rank]))
        return time.perf_counter() - start

    def servers(self) -> dict[int, dict]:
        """Every server rank: its LLM, replica, tensor-parallel rank, host and pid."""
        return {rank: {"llm": h.llm, "replica": h.replica, "tp_rank": h.tp_rank, "host": h.host, "pid": h.pid}
                for rank, h in sorted(self._links.hellos.items())}

    def server_memory(self) -> dict[int, dict]:
        """Memory use of every server rank (resident set size, peak, CUDA allocations, parameter bytes)."""
        self._check_open()
        ranks = sorted(self._run.roles)
        return self._wait(self._links.submit(protocol.STATS, [(ranks, {})], lambda v: dict(v)))

    def _sleep_async(self, seconds: float, llm: str | None = None, echo=None) -> concurrent.futures.Future:
        """Test hook: keep the ranks of ``llm`` busy for ``seconds``."""
        name = self._check_llm(llm)
        ranks = [r for replica in self._replicas(name) for r in replica]
        return self._links.submit(protocol.SLEEP, [(ranks, {"seconds": seconds, "echo": echo})],
                                  lambda v: v[ranks[0]])

    def close(self) -> None:
        """Stop every server cleanly (they exit 0). Further calls raise."""
        if self._closed:
            return
        self._closed = True
        self._run.shutdown(abort=False, reason="Caller.close()")

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self._run.shutdown(abort=True, reason=f"the script raised {exc_type.__name__}")


def _check_keys(keys) -> tuple[str, ...]:
    if isinstance(keys, str):
        keys = [keys]
    keys = tuple(keys or ())
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"head keys must be strings, got {type(k).__name__}")
    return keys


class _Finish:
    """Turn per-context server results into what score/custom_module_fns return."""

    def __init__(self, reduction, normalize, probabilities, keys, scores: bool):
        self.reduction, self.normalize, self.probabilities = reduction, normalize, probabilities
        self.keys, self.scores = keys, scores

    def __call__(self, entries: list[dict]):
        out = []
        for entry in entries:
            value = entry["scores"]
            if self.reduction == "mean":
                value = value / entry["counts"].clamp(min=1).to(value.dtype)
            if self.normalize and value.numel():
                value = value.log_softmax(0)
            if self.probabilities:
                value = value.exp()
            if not self.scores:
                out.append(dict(entry["heads"]))
            elif self.keys:
                out.append({"score": value, **entry["heads"]})
            else:
                out.append(value)
        return out


def _startup_bar(progress: bool, total: int):
    """A progress bar of servers connecting (None when progress is off or tqdm is missing)."""
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, desc="llmrl: servers connected", unit="rank", leave=False, file=sys.stderr,
               disable=None)  # None: shown on a terminal, silent in logs

    def update_to(done: int, _total: int) -> None:
        if done != bar.n:
            bar.n = done
            bar.refresh()

    bar.update_to = update_to
    return bar


def _finish_generation(samples: list[dict]) -> list[dict]:
    return [{**s, "logprob": float(s["logprobs"].sum())} for s in samples]


def run_client(config: Config, run_script) -> int:
    """Entry point of rank 0: host the run, run the script, stop the servers. Returns the exit code."""
    import signal

    from llmrl.engine.server import exit_with_parent

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    exit_with_parent(signal.SIGTERM)
    run = ClientRun(config)
    set_current_run(run)
    try:
        code = run_script()
    finally:
        set_current_run(None)
    failed = code != 0 or bool(run.links.dead)
    reason = "the script finished" if not failed else f"the script exited with code {code}"
    run.shutdown(abort=failed, reason=reason)
    if run.links.dead and code == 0:
        code = 1
    return code


def describe_exit(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
