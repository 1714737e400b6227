"""The client API: :class:`Caller`, which your RL script uses to reach the LLM servers of its run.

``Caller()`` finds the run rank 0 hosts (:mod:`llmrl.engine.client.hosting`), waits for every server rank, sends
them the plugins given by the script, and serves its calls. The Caller is a composition of parts, each an object
of its own module given what it uses in its constructor:

- :class:`~llmrl.engine.client.call_context.CallContext`: the run, the config, whether the Caller is open, the
  LLMs' descriptions from setup and the wait on a future, shared by every part;
- :class:`~llmrl.engine.client.inference_calls.InferenceCalls`: ``score``, ``custom_module_fns``, ``generate``
  (each with an ``_async`` twin returning a future; calls to different LLMs run concurrently), ``tokenize``,
  ``state_dict``;
- :class:`~llmrl.engine.client.training_calls.ClientTraining`: ``update`` and the steps whose loss lives in the
  script (``forward_backward``, ``optim_step``...);
- :class:`~llmrl.engine.client.adapter_calls.AdapterCalls`: snapshots and adapters made at run time;
- :class:`~llmrl.engine.client.tracking_calls.TrackingCalls`: experiment tracking (``log``, ``server_memory``);
- :class:`~llmrl.engine.client.run_calls.RunCalls`: ``save``, ``ping``, ``servers``, ``close_llm``;
- :class:`~llmrl.engine.client.evaluation.Evaluation`: ``evaluate`` (a task's mean reward and pass@k, with
  confidence intervals, through ``generate`` and ``log``).

Each public method of the Caller is a thin delegation to its part (:func:`~llmrl.engine.client.call_context.delegated`
gives it the part's docstring and checks the two signatures agree); the Caller itself holds the start-up,
``close``, the served tokenizer (:mod:`llmrl.engine.client.chat`) and ``run_episodes``
(:mod:`llmrl.engine.client.episodes`). A call to the servers checks its arguments and hands them to its request
kind (:mod:`llmrl.engine.requests`), which splits them across the replicas of the target LLM and assembles the
replies: results come back in order as CPU tensors and plain Python.

This module computes nothing, splits nothing, sends nothing itself and writes no checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from typing import Any

from llmrl.engine.client import saving
from llmrl.engine.client.adapter_calls import AdapterCalls
from llmrl.engine.client.call_context import CallContext, delegated
from llmrl.engine.client.episodes import Episode, run_episodes
from llmrl.engine.client.evaluation import Evaluation
from llmrl.engine.client.hosting import current_run, startup_bar
from llmrl.engine.client.inference_calls import InferenceCalls
from llmrl.engine.client.run_calls import RunCalls
from llmrl.engine.client.tracking_calls import TrackingCalls, start_tracker
from llmrl.engine.client.training_calls import ClientTraining
from llmrl.engine.requests import admin


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
        self.config = run.config
        self._context: CallContext = CallContext(run, self.config.timeouts.request if timeout is None else timeout)
        seeds = saving.generate_seeds(self.config)  # as a resumed checkpoint left it
        self.tracker = start_tracker(self.config, tracking)
        self._tracking: TrackingCalls = TrackingCalls(self._context, self.tracker)
        self._inference: InferenceCalls = InferenceCalls(self._context, seeds)
        self._training: ClientTraining = ClientTraining(self._context, self._tracking)
        self._adapters: AdapterCalls = AdapterCalls(self._context)
        self._run_calls: RunCalls = RunCalls(self._context, seeds, self.tracker)
        self._evaluation: Evaluation = Evaluation(self._inference.generate, self._tracking.log)
        target = self._context.target(llm)
        plugins: dict[str, dict[str, Any]] = {target: given} if given else {}
        bar = startup_bar(progress, len(run.roles))
        try:
            run.links.wait_connected(self.config.timeouts.startup, bar.update_to if bar else None)
            if bar:
                bar.set_description("llmrl: building engines")
            self._context.info.update(self._context.wait(admin.send_setup(run, plugins, run.roles),
                                                         self.config.timeouts.startup))
        finally:
            if bar:
                bar.close()
        self.info: dict[str, dict] = self._context.info
        run.caller = self

    @property
    def llms(self) -> list[str]:
        """Names of the LLMs of this run, in config order (the first is the default)."""
        return list(self.config.llms)

    @property
    def tokenizer(self):
        """The first LLM's tokenizer (see :meth:`get_tokenizer`)."""
        return self.get_tokenizer()

    def get_tokenizer(self, llm: str | None = None):
        """The Hugging Face tokenizer LLM ``llm`` serves with, on the client (no model is loaded)."""
        return self._context.tokenizers.get(self._context.open(llm))

    @delegated(InferenceCalls.score_async)
    def score_async(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum",
                    normalize: bool = False, probabilities: bool = False, minibatch_size: int | None = None,
                    additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None,
                    per_token: bool = False, entropy: bool = False, add_eos: bool = False,
                    head_kwargs: dict | None = None) -> concurrent.futures.Future:
        return self._inference.score_async(contexts, candidates, llm=llm, reduction=reduction, normalize=normalize,
                                           probabilities=probabilities, minibatch_size=minibatch_size,
                                           additional_module_function_keys=additional_module_function_keys,
                                           peft_adapter=peft_adapter, per_token=per_token, entropy=entropy,
                                           add_eos=add_eos, head_kwargs=head_kwargs)

    @delegated(InferenceCalls.score)
    def score(self, contexts, candidates, *, llm: str | None = None, reduction: str = "sum", normalize: bool = False,
              probabilities: bool = False, minibatch_size: int | None = None,
              additional_module_function_keys: Sequence[str] = (), peft_adapter: str | None = None,
              per_token: bool = False, entropy: bool = False, add_eos: bool = False, head_kwargs: dict | None = None):
        return self._inference.score(contexts, candidates, llm=llm, reduction=reduction, normalize=normalize,
                                     probabilities=probabilities, minibatch_size=minibatch_size,
                                     additional_module_function_keys=additional_module_function_keys,
                                     peft_adapter=peft_adapter, per_token=per_token, entropy=entropy, add_eos=add_eos,
                                     head_kwargs=head_kwargs)

    @delegated(InferenceCalls.custom_module_fns_async)
    def custom_module_fns_async(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                                peft_adapter: str | None = None, minibatch_size: int | None = None,
                                add_eos: bool = False, head_kwargs: dict | None = None) -> concurrent.futures.Future:
        return self._inference.custom_module_fns_async(keys, contexts, candidates, llm=llm, peft_adapter=peft_adapter,
                                                       minibatch_size=minibatch_size, add_eos=add_eos,
                                                       head_kwargs=head_kwargs)

    @delegated(InferenceCalls.custom_module_fns)
    def custom_module_fns(self, keys: Sequence[str], contexts, candidates=None, *, llm: str | None = None,
                          peft_adapter: str | None = None, minibatch_size: int | None = None,
                          add_eos: bool = False, head_kwargs: dict | None = None) -> list[dict]:
        return self._inference.custom_module_fns(keys, contexts, candidates, llm=llm, peft_adapter=peft_adapter,
                                                 minibatch_size=minibatch_size, add_eos=add_eos,
                                                 head_kwargs=head_kwargs)

    @delegated(InferenceCalls.generate_async)
    def generate_async(self, contexts, *, llm: str | None = None, peft_adapter: str | list[str] | None = None,
                       seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs
                       ) -> concurrent.futures.Future:
        return self._inference.generate_async(contexts, llm=llm, peft_adapter=peft_adapter, seed=seed,
                                              minibatch_size=minibatch_size, **generate_kwargs)

    @delegated(InferenceCalls.generate)
    def generate(self, contexts, *, llm: str | None = None, peft_adapter: str | list[str] | None = None,
                 seed: int | None = None, minibatch_size: int | None = None, **generate_kwargs) -> list[list[dict]]:
        return self._inference.generate(contexts, llm=llm, peft_adapter=peft_adapter, seed=seed,
                                        minibatch_size=minibatch_size, **generate_kwargs)

    @delegated(ClientTraining.update_async)
    def update_async(self, contexts, candidates=None, *, llm: str | None = None, **kwargs
                     ) -> concurrent.futures.Future:
        return self._training.update_async(contexts, candidates, llm=llm, **kwargs)

    @delegated(ClientTraining.update)
    def update(self, contexts, candidates=None, *, llm: str | None = None, **kwargs) -> list[dict]:
        return self._training.update(contexts, candidates, llm=llm, **kwargs)

    @delegated(RunCalls.save)
    def save(self, path: str | os.PathLike, *, client_state=None) -> str:
        return self._run_calls.save(path, client_state=client_state)

    @delegated(RunCalls.resumed_client_state)
    def resumed_client_state(self):
        return self._run_calls.resumed_client_state()

    @delegated(InferenceCalls.state_dict)
    def state_dict(self, llm: str | None = None, prefix: str = "", replica: int | None = None) -> dict:
        return self._inference.state_dict(llm, prefix, replica)

    @delegated(InferenceCalls.tokenize)
    def tokenize(self, contexts, candidates=None, *, llm: str | None = None) -> list[dict]:
        return self._inference.tokenize(contexts, candidates, llm=llm)

    @delegated(RunCalls.sync_weights)
    def sync_weights(self, source: str, target: str, *, peft_adapter: str | None = None,
                     in_flight: bool = False, via: str = "group") -> dict:
        return self._run_calls.sync_weights(source, target, peft_adapter=peft_adapter, in_flight=in_flight,
                                            via=via)

    @delegated(RunCalls.sync_weights_async)
    def sync_weights_async(self, source: str, target: str, *, peft_adapter: str | None = None,
                           in_flight: bool = False, via: str = "group") -> concurrent.futures.Future:
        return self._run_calls.sync_weights_async(source, target, peft_adapter=peft_adapter, in_flight=in_flight,
                                                  via=via)

    @delegated(RunCalls.ping)
    def ping(self, rank: int | None = None) -> float:
        return self._run_calls.ping(rank)

    @delegated(RunCalls.servers)
    def servers(self) -> dict[int, dict]:
        return self._run_calls.servers()

    @delegated(RunCalls.close_llm)
    def close_llm(self, llm: str) -> None:
        return self._run_calls.close_llm(llm)


    def close(self) -> None:
        """Stop every server cleanly (they exit 0). Further calls raise."""
        if self._context.closed:
            return
        self._context.closed = True
        self._tracking.close(quiet=True)
        self._context.run.shutdown(abort=False, reason="Caller.close()")

    def __enter__(self) -> Caller:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._context.closed = True
            self._tracking.close(quiet=True)
            self._context.run.shutdown(abort=True, reason=f"the script raised {exc_type.__name__}")


    @delegated(ClientTraining.forward_backward_async)
    def forward_backward_async(self, data, loss_fn: str, loss_fn_config: dict | None = None, *,
                               llm: str | None = None, peft_adapter: str | list[str] | None = None,
                               policy_versions=None) -> concurrent.futures.Future:
        return self._training.forward_backward_async(data, loss_fn, loss_fn_config, llm=llm, peft_adapter=peft_adapter,
                                                     policy_versions=policy_versions)

    @delegated(ClientTraining.forward_backward)
    def forward_backward(self, data, loss_fn: str, loss_fn_config: dict | None = None, *, llm: str | None = None,
                         peft_adapter: str | list[str] | None = None, policy_versions=None) -> dict:
        return self._training.forward_backward(data, loss_fn, loss_fn_config, llm=llm, peft_adapter=peft_adapter,
                                               policy_versions=policy_versions)

    @delegated(ClientTraining.forward_async)
    def forward_async(self, data, loss_fn: str | None = None, loss_fn_config: dict | None = None, *,
                      llm: str | None = None, peft_adapter: str | list[str] | None = None) -> concurrent.futures.Future:
        return self._training.forward_async(data, loss_fn, loss_fn_config, llm=llm, peft_adapter=peft_adapter)

    @delegated(ClientTraining.forward)
    def forward(self, data, loss_fn: str | None = None, loss_fn_config: dict | None = None, *,
                llm: str | None = None, peft_adapter: str | list[str] | None = None) -> dict:
        return self._training.forward(data, loss_fn, loss_fn_config, llm=llm, peft_adapter=peft_adapter)

    @delegated(ClientTraining.forward_backward_custom)
    def forward_backward_custom(self, data, loss_fn, *, llm: str | None = None,
                                peft_adapter: str | list[str] | None = None) -> dict:
        return self._training.forward_backward_custom(data, loss_fn, llm=llm, peft_adapter=peft_adapter)

    @delegated(ClientTraining.optim_step_async)
    def optim_step_async(self, adam_params=None, *, llm: str | None = None, peft_adapter: str | None = None
                         ) -> concurrent.futures.Future:
        return self._training.optim_step_async(adam_params, llm=llm, peft_adapter=peft_adapter)

    @delegated(ClientTraining.optim_step)
    def optim_step(self, adam_params=None, *, llm: str | None = None, peft_adapter: str | None = None) -> dict:
        return self._training.optim_step(adam_params, llm=llm, peft_adapter=peft_adapter)

    @delegated(AdapterCalls.snapshot)
    def snapshot(self, name: str, *, llm: str | None = None, peft_adapter: str | None = None) -> dict:
        return self._adapters.snapshot(name, llm=llm, peft_adapter=peft_adapter)

    @delegated(AdapterCalls.drop_snapshot)
    def drop_snapshot(self, name: str, *, llm: str | None = None) -> dict:
        return self._adapters.drop_snapshot(name, llm=llm)

    @delegated(AdapterCalls.create_adapter)
    def create_adapter(self, name: str, *, rank: int = 8, alpha: float | None = None, seed: int = 0,
                       targets=None, llm: str | None = None) -> dict:
        return self._adapters.create_adapter(name, rank=rank, alpha=alpha, seed=seed, targets=targets, llm=llm)

    @delegated(AdapterCalls.delete_adapter)
    def delete_adapter(self, name: str, *, llm: str | None = None) -> dict:
        return self._adapters.delete_adapter(name, llm=llm)

    @delegated(AdapterCalls.save_adapter)
    def save_adapter(self, path: str | os.PathLike, *, peft_adapter: str | None = None, llm: str | None = None
                     ) -> dict:
        return self._adapters.save_adapter(path, peft_adapter=peft_adapter, llm=llm)

    @delegated(AdapterCalls.load_adapter)
    def load_adapter(self, path: str | os.PathLike, name: str, *, optimizer: bool = True,
                     llm: str | None = None) -> dict:
        return self._adapters.load_adapter(path, name, optimizer=optimizer, llm=llm)

    @delegated(Evaluation.evaluate)
    def evaluate(self, task, *, samples: int = 0, k: Sequence[int] | None = None, greedy: bool = True,
                 seed: int = 0, ci: str = "normal", confidence: float = 0.95, log: bool | str = True,
                 **generate_kwargs) -> dict:
        return self._evaluation.evaluate(task, samples=samples, k=k, greedy=greedy, seed=seed, ci=ci,
                                         confidence=confidence, log=log, **generate_kwargs)

    def run_episodes(self, envs, **kwargs) -> list[Episode]:
        """Play one episode in each of ``envs`` with this Caller's LLM as the agent (:func:`run_episodes`)."""
        return run_episodes(self, envs, **kwargs)


    @delegated(TrackingCalls.log)
    def log(self, metrics: dict, step: int | None = None, *, backends=None) -> None:
        return self._tracking.log(metrics, step, backends=backends)

    @delegated(TrackingCalls.server_memory)
    def server_memory(self) -> dict[int, dict]:
        return self._tracking.server_memory()
