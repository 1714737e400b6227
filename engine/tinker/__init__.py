"""A Tinker-compatible service: the public ``tinker`` SDK, and the ``tinker-cookbook`` recipes written against it, train
and sample through an llmrl run.

Rank 0's script is :mod:`llmrl.engine.tinker.serve`: it holds the run's :class:`~llmrl.Caller` and serves Tinker's
REST API (:mod:`~llmrl.engine.tinker.http`) on it. Each Tinker call maps to llmrl's primitives
(:mod:`~llmrl.engine.tinker.service`): a training client is a LoRA adapter created at run time, ``forward_backward``
and ``optim_step`` are the Caller's, a sampler's weights are a named snapshot. Requests complete as futures the SDK
polls (:mod:`~llmrl.engine.tinker.futures`); the forward/backward and sampling payloads are the SDK's protobuf
messages (:mod:`~llmrl.engine.tinker.wire`). The SDK (``pip install llmrl[tinker]``) supplies the protobuf schema.
"""
