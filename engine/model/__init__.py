"""Compute on one server rank, behind the model-backend seam (``backend``): the Hugging Face + DeepSpeed
backend (``hf_backend``) with the module DeepSpeed wraps (``module``), tokenisation, batch planning and the
scoring passes (``tokenization``, ``batching``, ``scoring``, ``forward``), generation, training, checkpoints,
model loading and the offline builtin and tiny models."""
