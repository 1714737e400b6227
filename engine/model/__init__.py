"""Compute on one server rank, behind the model-backend seam.

- ``backend`` (the seam every backend implements), ``hf_backend`` (Hugging Face + DeepSpeed), ``served`` (the
  model a rank serves, its heads and adapters), ``module`` (what DeepSpeed wraps: the model and its heads, whose
  forward runs one planned request), ``forward`` (one request's pass: plan, agree with the other replicas, run),
  ``generation``, ``checkpoint``, ``deepspeed_config``;
- ``scoring/``: tokenise, plan and run the scoring passes, collect their results;
- ``reuse/``: the key/value cache across calls, the frozen trunk, the Hugging Face cache glue;
- ``store/``: loading models, the offline builtin and tiny models, their folders on disk;
- ``training/``: the trainer updaters drive, the update's run, the optimizer's per-adapter groups.

Nothing here opens a socket or knows about request kinds."""
