"""Launching runs: the entry point of every rank (``python -m llmrl.launch``) and the ``llmrl`` CLI."""
