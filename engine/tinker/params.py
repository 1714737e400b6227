"""Tinker's request fields read as llmrl's call arguments: the losses served and the inputs each reads, the
optimizer, the sampling parameters, the prompt's chunks and the sample fields this service does not compute.

- ``forward_backward``: each datum's per-token inputs are passed as given, those the loss does not read left out
  (a datum's per-token clip thresholds are read by ``ppo``, ``cispo`` and ``gspo``; ``cross_entropy`` without
  ``weights`` weighs every target token 1); ``stable_reinforce`` (whose
  sampling data is not public) is refused with the losses to use instead.
- A training client's id is Tinker's ``<session_id>:train:<model_seq_id>``; it begins the client's ``tinker://``
  paths, so a session id with a ``/`` is refused.
- A training client or sampler that names a ``base_model`` must name the served one (the config's ``model``, or
  the folder it resolves to): another name is refused naming both, never answered silently by the served model.
- Training clients step AdamW, Tinker's optimizer (decoupled weight decay): a service whose config names another
  (``training.optimizer.type``) refuses to make one.
- Sampling: ``temperature`` 0 is greedy decoding, computed once and copied to each of ``num_samples`` (Hugging Face
  refuses several return sequences of a greedy search); ``max_tokens`` left unset runs to the model's maximum
  length, at most :data:`UNSET_MAX_TOKENS` new tokens; ``stop`` as Tinker reads it (token ids: any of them; ``[]``:
  not even at EOS).

- ``optim_step``'s metrics: ``grad_norm:mean``; a float16 step skipped for a loss-scale overflow reports
  ``skipped:sum`` 1 and the halved ``loss_scale:mean`` instead (its gradients were dropped).

This module maps fields; the service (:mod:`llmrl.engine.tinker.service`) makes the calls.
"""

from __future__ import annotations

UNSET_MAX_TOKENS = 4096  # new tokens when max_tokens is unset and the model's length leaves more room (its cache:
# rows x (prompt + new tokens); a 128k-token context would hold 16 GB a row for an 8B model)

UNSERVED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                          "prompt_alt_tokens_k", "prompt_logprobs_last_n")


def check_loss(loss_fn: str) -> None:
    """Refuse a loss this service does not serve: one not registered (:mod:`llmrl.engine.token_losses`)."""
    from llmrl.engine.token_losses import REGISTRY

    if loss_fn == "stable_reinforce":
        first, *others = [name for name, loss in REGISTRY.items() if "advantages" in loss.inputs]
        raise ValueError("loss_fn 'stable_reinforce' is not supported (its sampling data is not public): pass "
                         f"loss_fn={first} (or {', '.join(others)})")
    if loss_fn not in REGISTRY:
        raise ValueError(f"loss_fn {loss_fn!r} is not supported; llmrl serves {', '.join(REGISTRY)}")


def loss_inputs(loss_fn: str, given: dict) -> dict:
    """The per-token inputs of a datum ``loss_fn`` reads (with its ``target_tokens``), the others left out;
    ``cross_entropy`` without ``weights`` weighs every token 1 (the SDK's own example gives none)."""
    from llmrl.engine.token_losses import REGISTRY

    loss = REGISTRY[loss_fn]
    reads = {"target_tokens", *loss.inputs, *loss.optional_inputs}
    inputs = {key: value for key, value in given.items() if key in reads}
    if loss_fn == "cross_entropy" and "weights" not in inputs and "target_tokens" in inputs:
        inputs["weights"] = [1.0] * len(inputs["target_tokens"])
    return inputs


def check_base_model(body: dict, served: tuple[str, ...]) -> None:
    """Refuse a ``base_model`` other than the served model's names (``served``: the config's ``model`` first)."""
    named = body.get("base_model")
    if named is not None and named not in served:
        raise ValueError(f"base_model {named!r} is not the model this service serves, {served[0]!r}: the answers "
                         f"would come from {served[0]!r}. Create the client with base_model={served[0]!r} (the name "
                         "get_server_capabilities lists), or start a service of that model")


def check_optimizer(body: dict, config_type: str) -> None:
    """Tinker's optimizer is AdamW: refuse another asked for, or a config that steps another."""
    optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r} is not supported: llmrl steps AdamW (the config's "
                         "training.optimizer)")
    if config_type != "adamw":
        raise ValueError(f"this service's config trains with {config_type!r} (training.optimizer.type), but Tinker's "
                         "optimizer is AdamW, whose weight decay is decoupled from the gradient: set "
                         "training.optimizer.type: adamw in the service's config")


def generate_kwargs(params: dict, count: int, prompt_logprobs: bool, room: int | None = None) -> dict:
    """``generate`` arguments for Tinker's sampling parameters; ``room``: the new tokens the model's maximum length
    leaves after the prompt (the bound when ``max_tokens`` is unset). Greedy decoding asks for one sequence (the
    service copies it ``count`` times)."""
    temperature = float(params.get("temperature", 1.0))
    max_tokens = params.get("max_tokens")
    if max_tokens is None and room is None:
        raise ValueError("sampling_params.max_tokens is unset and this model declares no maximum length: set "
                         "max_tokens")
    kwargs = {"max_new_tokens": int(min(room, UNSET_MAX_TOKENS) if max_tokens is None else max_tokens),
              "num_return_sequences": count if temperature > 0 else 1, "do_sample": temperature > 0}
    if temperature > 0:
        top_k = int(params.get("top_k", -1))
        kwargs.update(temperature=temperature, top_k=0 if top_k < 0 else top_k, top_p=float(params.get("top_p", 1.0)))
    if params.get("seed") is not None:
        kwargs["seed"] = int(params["seed"])
    stop = params.get("stop")
    if stop == []:  # Tinker: no stop at all, not even at EOS; generation runs to max_tokens
        kwargs["eos_token_id"] = []
    elif isinstance(stop, (list, tuple)) and all(isinstance(t, int) for t in stop):
        kwargs["stop"] = [[int(t)] for t in stop]  # Tinker: stop at any of these tokens (llmrl: one sequence)
    elif stop:
        kwargs["stop"] = stop
    if prompt_logprobs:
        kwargs["prompt_logprobs"] = True
    return kwargs


def step_metrics(out: dict) -> dict[str, float]:
    """Tinker's ``optim_step`` metrics of an answer of ``Caller.optim_step``."""
    if out.get("skipped"):
        return {"skipped:sum": 1.0, "loss_scale:mean": float(out["loss_scale"])}
    return {} if out.get("grad_norm") is None else {"grad_norm:mean": out["grad_norm"]}


def refuse_unserved(body: dict) -> None:
    """A sample request asking for what this service does not compute is refused, not answered without it."""
    asked = [name for name in UNSERVED_SAMPLE_FIELDS if body.get(name) not in (None, 0, False)]
    if asked:
        raise ValueError(f"sample request field(s) {asked} are not served by llmrl's Tinker service (it returns the "
                         "sampled tokens' log-probs, and with prompt_logprobs every prompt token's): leave them unset")


def chunk_tokens(chunk: dict) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise ValueError(f"prompt chunks of type {chunk.get('type')!r} are not supported: llmrl serves text models")
    return [int(t) for t in chunk["tokens"]]


def new_model_id(body: dict) -> str:
    """The id of the training client a request makes, Tinker's ``<session_id>:train:<model_seq_id>`` (it begins the
    client's ``tinker://`` paths: the session id holds no ``/``)."""
    session, seq = body["session_id"], body.get("model_seq_id", 0)
    if not isinstance(session, str) or not session or "/" in session:
        raise ValueError(f"session_id {session!r} must be a non-empty string without '/' (create_session gives one)")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"model_seq_id must be a non-negative integer, got {seq!r}")
    return f"{session}:train:{seq}"
