"""Where models come from: loading a configured model (``loading``), the offline builtin models (``builtin_models``,
``tiny_models``) and the model folders they are kept in on disk (``folders``). Nothing here serves or
trains a model: the backend does (:mod:`llmrl.engine.model.hf_backend`)."""
