"""Launching runs: the entry point of every rank (``python -m llmrl.launch``) and the ``llmrl`` CLI.

The engine never imports this package: launching depends on the engine, not the other way round."""
