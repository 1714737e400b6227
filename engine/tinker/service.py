"""What each Tinker call does on an llmrl run: sessions, training clients, samplers and checkpoints, mapped onto the
Caller's primitives.

- A **training client** (``create_model``) is a LoRA adapter created at run time on the served LLM, with the rank,
  seed and targets (attention, MLP, unembedding) Tinker asks for; its id is Tinker's ``<session>:train:<n>``. Its
  requests run one at a time in ``seq_id`` order.
- ``forward_backward`` / ``forward`` and ``optim_step`` are the Caller's, on that adapter (each adapter's gradients
  pending apart: :mod:`llmrl.engine.model.training.client_steps`); how request fields become arguments is
  :mod:`llmrl.engine.tinker.params`'. Several clients' ``forward_backward`` requests that arrive together share one
  call, each datum on its client's adapter (:mod:`llmrl.engine.tinker.shared_training`).
- ``save_weights_for_sampler`` takes a named snapshot of the adapter: with a name it answers a
  ``tinker://<model>/sampler_weights/<name>`` path, without one a sampling session on a snapshot kept among the
  client's last few (older ones are dropped: their sessions then answer an error).
- A **sampler** reads a snapshot, or the base model (the config's own LoRA adapter, which Tinker never trains: a
  LoRA adapter starts as the identity, so it is the base model until trained), through ``generate``; the log-probs
  it returns are those of the distribution it sampled from (``sampling_logprobs``). Requests with the same
  sampling parameters within a few milliseconds share one ``generate`` call, each prompt on its own sampler's
  weights (:mod:`llmrl.engine.tinker.batching`).
- ``save_weights`` (``save_state``) writes the adapter's weights and Adam state (``Caller.save_adapter``) under the
  service's folder (``overwrite=True`` replaces a state of that name, once the new one is written); ``load_weights``
  loads one into a new training client (``create_training_client_from_state``, with or without the optimizer state) or
  into an existing one (``Caller.load_adapter``). Paths, and the ``training_runs`` listings, are
  :mod:`llmrl.engine.tinker.checkpoints`'.

A request that makes or changes state is idempotent by its ids (the SDK resends one whose connection failed): the
same ``session_id`` and ``model_seq_id`` (``create_model``, ``load_weights`` into a new client), a training client's
``seq_id``, the same ``session_id`` and ``sampling_session_seq_id`` (``create_sampling_session``) or checkpoint
(``delete``) get the first request's future or answer back; nothing is made or applied twice.

This module holds the service's state and the mapping; HTTP is :mod:`llmrl.engine.tinker.http`'s.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import threading
from collections import deque
from dataclasses import dataclass, field

from llmrl.engine.adapter_names import one_adapter_or_rows
from llmrl.engine.tinker.batching import CallBatcher
from llmrl.engine.tinker.checkpoints import Checkpoint, Registry, StateError, checkpoint_name, folder_size, now
from llmrl.engine.tinker.futures import Futures, OrderedQueue, Outcome
from llmrl.engine.tinker.params import (
    check_base_model,
    check_loss,
    check_optimizer,
    chunk_tokens,
    generate_kwargs,
    loss_inputs,
    new_model_id,
    refuse_unserved,
    step_metrics,
)
from llmrl.engine.tinker.shared_training import SharedTraining
from llmrl.engine.tinker.wire import forward_backward_output, parse_forward_backward, sample_response

EPHEMERAL_SAMPLERS = 4  # snapshots kept per training client for samplers made without a name
MAX_NUM_SAMPLES = 4096  # samples of one sample request (each gets an id before any is drawn)
UNDECLARED_POSITIONS = 1 << 20  # a datum's tokens and values at most, for a model that declares no maximum length


@dataclass
class TrainingClient:
    model_id: str
    adapter: str
    base_model: str
    rank: int
    queue: OrderedQueue
    ephemeral: deque = field(default_factory=deque)  # snapshot names of unnamed samplers, oldest first


@dataclass
class Sampler:
    sampler_id: str
    weights: str  # the snapshot (or the base adapter) generate reads
    base_model: str
    model_path: str | None = None


class TinkerService:
    def __init__(self, caller, llm: str | None = None, save_dir: str = "tinker-checkpoints", poll_wait: float = 20.0):
        self.caller = caller
        self.llm = llm or caller.llms[0]
        info = caller.info[self.llm]
        if not info.get("adapters"):
            raise ValueError(f"the Tinker service trains LoRA adapters on LLM {self.llm!r}: give it the lora "
                             "initializer (its adapter, never trained, is the base model that samplers read)")
        self.base_adapter = info["adapters"][0]
        spec = caller.config.llms[self.llm]
        self.optimizer_type = spec.training.optimizer.type
        from llmrl.engine.model.store.loading import resolve_model_path

        self.tokenizer_id = resolve_model_path(spec.tokenizer or spec.model)
        self.model_name = spec.model
        self.model_names = (spec.model, resolve_model_path(spec.model))  # what a client's base_model may be
        self.positions = info.get("max_length") or UNDECLARED_POSITIONS  # bounds what a request may make us allocate
        self.registry = Registry(save_dir)
        self.poll_wait = poll_wait
        self._token = secrets.token_hex(4)  # session ids differ between services: their runs never share a folder
        self.futures = Futures(classify)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._adapter_ids = itertools.count(1)  # training client k trains adapter tinker_k
        self.models: dict[str, TrainingClient] = {}
        self._making: dict[str, str] = {}  # model id -> the request making it: a resent request gets it back
        self.samplers: dict[str, Sampler] = {}
        self._sampling_sessions: dict[tuple, str] = {}  # (session, sampling_session_seq_id) -> its sampler's id
        # a call in flight per replica (a call of one prompt keeps one busy), and one more waiting at the servers
        self.batcher = CallBatcher(self._generate, in_flight=spec.replicas + 1, shared=lambda key: key[1])
        self.training = SharedTraining(caller, self.llm, in_flight=spec.replicas + 1)

    # ------------------------------------------------------------------ sessions

    def create_session(self, body: dict) -> dict:
        return {"type": "create_session", "session_id": f"session-{self._token}-{next(self._ids)}"}

    def get_server_capabilities(self) -> dict:
        return {"supported_models": [{"model_name": self.model_name, "trainable": True, "sampleable": True}]}

    # ------------------------------------------------------------------ training clients

    def create_model(self, body: dict) -> dict:
        check_base_model(body, self.model_names)
        model_id = new_model_id(body)
        lora = body.get("lora_config") or {}
        targets = [name for name, key in (("attention", "train_attn"), ("mlp", "train_mlp"),
                                          ("unembed", "train_unembed")) if lora.get(key, True)]

        def work() -> Outcome:
            check_optimizer(body, self.optimizer_type)
            adapter = f"tinker_{next(self._adapter_ids)}"
            rank = int(lora.get("rank", 32))
            seed = lora.get("seed")
            seed = secrets.randbelow(2**31) if seed is None else seed  # Tinker: no seed means a random one
            self.caller.create_adapter(adapter, rank=rank, seed=seed, targets=targets, llm=self.llm)
            self._register(model_id, adapter, body, rank)
            return Outcome("json", {"type": "create_model", "model_id": model_id})

        return self._make_once(model_id, work)

    def _make_once(self, model_id: str, work) -> dict:
        """Submit the request making training client ``model_id``, once: a request resent with the same
        ``session_id`` and ``model_seq_id`` (the SDK resends one whose connection failed) gets the first one's id."""
        with self._lock:
            if model_id not in self._making:
                self._making[model_id] = self.futures.submit(work)
            return {"request_id": self._making[model_id], "model_id": model_id}

    def _register(self, model_id: str, adapter: str, body: dict, rank: int) -> None:
        base_model = body.get("base_model") or self.model_name
        with self._lock:
            self.models[model_id] = TrainingClient(model_id, adapter, base_model, rank,
                                                   OrderedQueue(self.futures, adapter))
        self.registry.add_run(model_id, base_model, rank, body.get("user_metadata"))

    def get_info(self, body: dict) -> dict:
        client = self._client(body["model_id"])
        return {"type": "get_info", "model_id": client.model_id, "is_lora": True, "lora_rank": client.rank,
                "model_name": client.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": self.caller.info[self.llm].get("kind", "causal"),
                               "model_name": client.base_model, "tokenizer_id": self.tokenizer_id}}

    def forward_backward(self, body: bytes) -> dict:
        request = parse_forward_backward(body, self.positions)
        client = self._client(request["model_id"])

        def work() -> Outcome:
            loss_fn, forward_only = request["loss_fn"], request["forward_only"]
            check_loss(loss_fn)
            data = [{"model_input": d["model_input"], "loss_fn_inputs": loss_inputs(loss_fn, d["loss_fn_inputs"])}
                    for d in request["data"]]
            out = self.training.run(client.adapter, data, loss_fn, request["loss_fn_config"] or None, forward_only,
                                    together=len(self.models) > 1)  # (other clients' requests may join the call)
            return Outcome("proto", forward_backward_output(out["outputs"], {"loss:sum": out["loss"]}))

        return self._in_order(client, request, work)

    def optim_step(self, body: dict) -> dict:
        client = self._client(body["model_id"])
        params = body.get("adam_params")

        def work() -> Outcome:
            if params is None:
                raise ValueError(f"optimizer parameters {body.get('optimizer_params')!r} are not supported: send "
                                 "AdamParams")
            out = self.caller.optim_step(params, llm=self.llm, peft_adapter=client.adapter)
            return Outcome("json", {"type": "optim_step", "metrics": step_metrics(out)})

        return self._in_order(client, body, work)

    def save_weights_for_sampler(self, body: dict) -> dict:
        client = self._client(body["model_id"])
        name = checkpoint_name(body.get("path"))

        def work() -> Outcome:
            # a name saved again replaces its own snapshot's weights; any other save gets a snapshot of its own
            # (names are never folded into snapshot names, which two different names could then share)
            path = f"tinker://{client.model_id}/sampler_weights/{name}" if name else None
            earlier = self.registry.find(path) if path else None
            snapshot = earlier.snapshot if earlier is not None else f"{client.adapter}_s{next(self._ids)}"
            self.caller.snapshot(snapshot, llm=self.llm, peft_adapter=client.adapter)
            if name:
                record = Checkpoint(client.model_id, "sampler_weights", name, now(), snapshot=snapshot)
                self.registry.add(record)  # a name saved again: the same snapshot, its weights replaced
                return Outcome("json", {"type": "save_weights_for_sampler", "path": record.tinker_path})
            client.ephemeral.append(snapshot)
            while len(client.ephemeral) > EPHEMERAL_SAMPLERS:
                self.caller.drop_snapshot(client.ephemeral.popleft(), llm=self.llm)
            sampler = self._new_sampler(snapshot, client.base_model)
            return Outcome("json", {"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id})

        return self._in_order(client, body, work)

    def save_weights(self, body: dict) -> dict:
        client = self._client(body["model_id"])
        name = checkpoint_name(body.get("path")) or f"state-{next(self._ids)}"

        def work() -> Outcome:
            folder = self.registry.state_folder(client.model_id, name)  # run ids are this service's own
            with self.registry.naming(f"tinker://{client.model_id}/weights/{name}", folder):
                return self._save(client, name, folder, bool(body.get("overwrite")))

        return self._in_order(client, body, work)

    def _save(self, client: TrainingClient, name: str, folder: str, overwrite: bool) -> Outcome:
        """``save_weights``' work: the state written (an existing one replaced once the new one is, if asked)."""
        if os.path.isdir(folder + "%old") and not os.path.isdir(folder):  # an overwrite cut between its renames
            os.replace(folder + "%old", folder)  # the old state, whole
        shutil.rmtree(folder + "%old", ignore_errors=True)  # an overwrite cut after them: the replaced state
        replace = os.path.isdir(folder)  # "%new" and "%old" end no escaped name
        if replace and not overwrite:
            raise ValueError(f"this training client already saved a state named {name!r}: pick another name, "
                             "or save_state(name, overwrite=True) to replace it")
        shutil.rmtree(folder + "%new", ignore_errors=True)  # left by a save that failed
        self.caller.save_adapter(folder + "%new" if replace else folder, peft_adapter=client.adapter, llm=self.llm)
        if replace:  # the old state stays whole until the new one is
            os.replace(folder, folder + "%old")
            os.replace(folder + "%new", folder)
            shutil.rmtree(folder + "%old")
        record = Checkpoint(client.model_id, "weights", name, now(), size_bytes=folder_size(folder))
        self.registry.add(record)
        return Outcome("json", {"type": "save_weights", "path": record.tinker_path})

    def load_weights(self, body: dict) -> dict:
        """Into an existing training client (``model_id``, deprecated ``load_state``), or into a new one made from
        the state (``session_id`` + ``model_seq_id``: ``create_training_client_from_state[_with_optimizer]``)."""
        optimizer = bool(body.get("optimizer"))
        if body.get("model_id"):
            client = self._client(body["model_id"])

            def load_into() -> Outcome:
                folder = self.registry.folder_of(body.get("path"))
                with self.registry.naming(body["path"], folder):
                    self.caller.load_adapter(folder, client.adapter, optimizer=optimizer, llm=self.llm)
                return Outcome("json", {"type": "load_weights", "path": body["path"]})

            return self._in_order(client, body, load_into)
        model_id = new_model_id(body)

        def create_from() -> Outcome:
            check_optimizer({} if optimizer else body, self.optimizer_type)  # the config's: AdamW either way
            folder = self.registry.folder_of(body.get("path"))
            adapter = f"tinker_{next(self._adapter_ids)}"
            with self.registry.naming(body["path"], folder):
                out = self.caller.load_adapter(folder, adapter, optimizer=optimizer, llm=self.llm)
            self._register(model_id, adapter, body, out["rank"])
            return Outcome("json", {"type": "load_weights", "path": body["path"], "model_id": model_id})

        return self._make_once(model_id, create_from)

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> dict:
        record = self.registry.remove(run_id, checkpoint_id)  # None: deleted already (a resent request)
        if record is not None and record.snapshot is not None:
            self.caller.drop_snapshot(record.snapshot, llm=self.llm)
        elif record is not None:
            folder = self.registry.state_folder(run_id, record.name)
            with self.registry.naming(record.tinker_path, folder):
                shutil.rmtree(folder)  # a folder this service wrote
        return {}

    # ------------------------------------------------------------------ samplers

    def create_sampling_session(self, body: dict) -> dict:
        """A sampler; one per ``(session_id, sampling_session_seq_id)``: a resent request gets the same one."""
        key = (body.get("session_id"), body.get("sampling_session_seq_id"))
        with self._lock:
            known = self._sampling_sessions.get(key) if None not in key else None
        if known is not None:
            return {"type": "create_sampling_session", "sampling_session_id": known}
        path = body.get("model_path")
        if path:
            record = self.registry.find(path)
            if record is None or record.snapshot is None:
                raise LookupError(f"no sampler weights at {path!r} on this service (sampler weights live as long "
                                  "as the service; save_weights_for_sampler(name) makes them)")
            weights, base_model = record.snapshot, self.model_name
        else:
            check_base_model(body, self.model_names)
            weights, base_model = self.base_adapter, body.get("base_model") or self.model_name
        sampler = self._new_sampler(weights, base_model, path or None, key=None if None in key else key)
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self._sampler(sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    def asample(self, body: dict) -> dict:
        sampler = self._sampler(body["sampling_session_id"])
        refuse_unserved(body)
        tokens = [t for chunk in body["prompt"]["chunks"] for t in chunk_tokens(chunk)]
        count = body.get("num_samples", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_NUM_SAMPLES:
            raise ValueError(f"num_samples must be an int from 1 to {MAX_NUM_SAMPLES}, got {count!r}: send several "
                             "requests for more samples")
        longest = self.caller.info[self.llm].get("max_length")
        kwargs = generate_kwargs(body.get("sampling_params") or {}, count, bool(body.get("prompt_logprobs")),
                                 None if longest is None else max(1, longest - len(tokens)))

        key = (sampler.weights, tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))
        pending = self.batcher.submit(key, tokens, alone="seed" in kwargs)

        def work() -> Outcome:
            samples = pending.result()
            samples = samples * count if len(samples) == 1 else samples  # greedy: one decoding, copied
            out = [{"tokens": s["tokens"].tolist(), "logprobs": s.get("sampling_logprobs", s["logprobs"]).tolist(),
                    "stop_reason": s["stop_reason"]} for s in samples]
            prompt = samples[0]["prompt_logprobs"].tolist() if kwargs.get("prompt_logprobs") else None
            return Outcome("proto", sample_response(out, prompt))

        request_id = self.futures.submit(work)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{k}" for k in range(count)]}

    def _generate(self, keys: list[tuple], prompts: list[list[int]]) -> list[list[dict]]:
        """One ``generate`` call for the prompts of requests that share sampling parameters; each prompt reads the
        weights of its own key (several samplers' prompts: several adapters in one batched pass)."""
        weights = one_adapter_or_rows([weights for weights, _ in keys])
        return self.caller.generate(prompts, llm=self.llm, peft_adapter=weights, **dict(keys[0][1]))

    # ------------------------------------------------------------------ futures

    def retrieve_future(self, body: dict) -> Outcome:
        request_id = body["request_id"]
        outcome = self.futures.wait(request_id, self.poll_wait)
        if outcome is None:
            return Outcome("json", {"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return outcome

    # ------------------------------------------------------------------ helpers

    def _in_order(self, client: TrainingClient, request: dict, work) -> dict:
        """Submit a training client's request, to run in its ``seq_id`` order."""
        self.registry.touch(client.model_id)
        return {"request_id": client.queue.submit(request.get("seq_id"), work), "model_id": client.model_id}

    def _client(self, model_id: str) -> TrainingClient:
        with self._lock:
            client = self.models.get(model_id)
        if client is None:
            raise LookupError(f"no training client {model_id!r}; this service holds {sorted(self.models) or 'none'}")
        return client

    def _sampler(self, sampler_id: str) -> Sampler:
        with self._lock:
            sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise LookupError(f"no sampling session {sampler_id!r}")
        return sampler

    def _new_sampler(self, weights: str, base_model: str, path: str | None = None, key: tuple | None = None) -> Sampler:
        with self._lock:
            if key in self._sampling_sessions:  # the same request, resent while the first was answered
                return self.samplers[self._sampling_sessions[key]]
            sampler = Sampler(f"sampler-{next(self._ids)}", weights, base_model, path)
            self.samplers[sampler.sampler_id] = sampler
            if key is not None:
                self._sampling_sessions[key] = sampler.sampler_id
        return sampler


def classify(err: BaseException) -> str:
    """Tinker's error category: "user" for requests refused for their content, "server" otherwise."""
    from llmrl.engine.errors import InvalidArgument, InvalidArgumentType, RequestError

    if isinstance(err, StateError):  # an error about a saved state, its folders named by its path
        return classify(err.cause)
    if isinstance(err, (InvalidArgument, InvalidArgumentType, ValueError, LookupError)):
        return "user"
    if isinstance(err, RequestError) and getattr(err, "remote_type", None) in ("ValueError", "InvalidArgument"):
        return "user"
    return "server"


def _frozen(value):
    """``value`` hashable (lists become tuples), for a batch's key."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value
