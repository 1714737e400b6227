"""The engine: how a call travels from your script to a model and back.

Folders follow the request path::

    client/     rank 0: Caller (the API), the run it reaches (hosting), links to every server rank
    requests/   one module per request kind: its payload, the client's split/assemble, the server's handler
    transport/  start-up discovery (rendezvous), messages and the frames that carry them over TCP
    server/     ranks 1..N-1: the serving loop, this rank's replica, the LLM's own world and its votes
    model/      compute behind the backend seam: Hugging Face + DeepSpeed, tokenisation, scoring, generation,
                training, checkpoints, model loading
    config/     the run's configuration (schema, loading, checks, typed objects) and every rank's role

Shared by all: ``errors`` (exceptions), ``log`` (the llmrl logger), ``processes`` (exit helpers) and
``checkpoint_layout`` (names inside a checkpoint folder); ``graph`` (zeros that keep tensors in the backward
graph, used by the scoring results and the plugins). Importing this package loads nothing heavy.
"""
