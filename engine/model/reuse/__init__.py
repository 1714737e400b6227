"""What scoring keeps to skip work: the key/value cache across calls (``prefix_cache``), the frozen trunk's hidden
states (``trunk``, which also owns the one model-call hook every scoring pass goes through) and the Hugging Face
key/value cache glue both use (``hf_kv``).
Nothing here decides what a pass computes or returns: scoring does (:mod:`llmrl.engine.model.scoring`)."""
