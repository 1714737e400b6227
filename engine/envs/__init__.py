"""Connectors to the ecosystem's environments: each module adapts one outside environment library to llmrl's
episodes (:func:`~llmrl.engine.client.episodes.run_episodes`, ``episode_batch``) or to the OpenAI endpoint's
token-exact capture. Each imports its library inside its functions, so ``import llmrl`` stays light. This package
re-exports nothing: import from its modules.
"""
