"""How the client and the servers reach each other: start-up discovery through stores (``rendezvous``),
the messages (``messages``) and the frames that carry them over TCP (``frames``).

Nothing here knows what a request means; :mod:`llmrl.engine.requests` does.
"""
