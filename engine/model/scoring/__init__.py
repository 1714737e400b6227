"""The scoring core: tokenise a request (``tokenization``), plan its batches (``planning``), run each batch
(``run``: ``causal``, ``packed`` or ``seq2seq``, with ``prefixes`` shared by the two causal paths) and collect
what the passes give (``results``). Pure compute over one model; no processes, no requests."""
