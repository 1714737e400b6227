"""Training on a server rank: the trainer updaters drive and the update request's run (``trainer``), and the
optimizer with its per-adapter parameter groups (``optimizer``). No loss is computed here: the updater plugins
compute them (:mod:`llmrl.plugins`)."""
