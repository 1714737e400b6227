"""An OpenAI-compatible endpoint with token-exact capture: any agent framework that speaks OpenAI's API samples from
an llmrl run, and the RL script trains on exactly the tokens the model saw and sampled.

``llmrl.openai_endpoint(caller)`` (:mod:`~llmrl.engine.openai_api.endpoint`) serves the API from a thread of the RL
script; ``llmrl openai`` (:mod:`~llmrl.engine.openai_api.serve`) is a run whose rank 0 only serves it. Requests are
routed and the key checked by :mod:`~llmrl.engine.openai_api.http`, their fields checked by
:mod:`~llmrl.engine.openai_api.params`, mapped onto ``Caller.generate`` by :mod:`~llmrl.engine.openai_api.service`
(chat messages rendered and completions read back by :mod:`~llmrl.engine.openai_api.chat_format`), and recorded by
rollout id as :class:`~llmrl.Trajectory` objects by :mod:`~llmrl.engine.openai_api.capture`. This package
re-exports nothing: import from its modules, or ``openai_endpoint`` from ``llmrl``.
"""
