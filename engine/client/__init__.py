"""Rank 0: the :class:`~llmrl.engine.client.caller.Caller` your script uses (``caller``), the run it reaches
(``hosting``), the links to every server rank (``links``) and atomic checkpoint swaps (``saving``). Nothing here
loads a model: rank 0 holds none."""
