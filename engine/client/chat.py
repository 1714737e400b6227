"""Chat messages as contexts, and the served tokenizer on the client.

A context may be a list of chat messages (``{"role": ..., "content": ...}`` dicts) instead of a string or token
ids: :func:`render_contexts` renders it with the served tokenizer's chat template, the generation prompt added
(``apply_chat_template(..., add_generation_prompt=True)``), into token ids that ``score``, ``generate`` and
``update`` then use exactly as given. Rendering happens on the client, with the same tokenizer files the servers
load (:class:`Tokenizers`: the LLM's ``tokenizer`` or ``model`` folder, a builtin model's converted folder
included), loaded once per LLM on first use; no model weights are loaded. A tokenizer without a chat template is
refused with the LLM's name.

This module renders and loads tokenizers; it sends nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from llmrl.engine.errors import InvalidArgument, InvalidArgumentType


def is_messages(context) -> bool:
    """Whether ``context`` is a list of chat messages (a non-empty sequence of mappings)."""
    return (isinstance(context, Sequence) and not isinstance(context, (str, bytes)) and len(context) > 0
            and all(isinstance(m, Mapping) for m in context))


def check_messages(messages, where: str) -> list[dict]:
    """Each message as a new dict with every key it has (``tool_calls``, ``name``, ``tool_call_id``... reach the
    template), once its ``role`` is a string and its ``content`` a string, a list of content parts, or absent or
    None beside ``tool_calls``."""
    out = []
    for k, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"{where}[{k}] needs a 'role' (a string such as 'system', 'user', 'assistant'), "
                                  f"got {role!r}")
        parts = isinstance(content, list) and all(isinstance(part, Mapping) for part in content)
        if not (isinstance(content, str) or parts or (content is None and message.get("tool_calls"))):
            raise InvalidArgumentType(f"{where}[{k}]['content'] must be a string or a list of content parts (or "
                                      f"None beside 'tool_calls'), got {type(content).__name__}")
        out.append(dict(message))
    return out


class Tokenizers:
    """The served tokenizer of each LLM, loaded on the client from the folder its servers read."""

    def __init__(self, config):
        self.config = config
        self._loaded: dict[str, object] = {}
        self._lock = threading.Lock()

    def get(self, llm: str):
        with self._lock:
            if llm not in self._loaded:
                self._loaded[llm] = self._load(llm)
            return self._loaded[llm]

    def _load(self, llm: str):
        from transformers import AutoTokenizer

        from llmrl.engine.model.store.loading import resolve_model_path

        spec = self.config.llms[llm]
        path = resolve_model_path(spec.tokenizer or spec.model)
        try:
            return AutoTokenizer.from_pretrained(path)
        except OSError as err:
            raise InvalidArgument(f"the tokenizer of LLM {llm!r} could not be loaded on the client from {path} "
                                  f"({err}); the client reads the same folder as the servers: make it reachable "
                                  "from rank 0's machine") from None


def render(contexts, candidates, tokenizer_of, llm: str):
    """``(contexts, candidates)`` with each list of chat messages replaced by its rendered token ids, and the string
    candidates of such a context encoded alone (no special tokens: the template's generation prompt ends at a token
    boundary); everything else as given. ``tokenizer_of(llm)`` is called only when a context holds messages."""
    if isinstance(contexts, str) or not isinstance(contexts, Sequence) or not any(is_messages(c) for c in contexts):
        return contexts, candidates  # check_contexts names what is wrong, if anything
    tokenizer = tokenizer_of(llm)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(f"contexts hold chat messages but the tokenizer of LLM {llm!r} has no chat template: "
                              "give strings or token ids, or a tokenizer with one (llms.<name>.tokenizer)")
    contexts, candidates = list(contexts), None if candidates is None else list(candidates)
    for i, context in enumerate(contexts):
        if not is_messages(context):
            continue
        ids = tokenizer.apply_chat_template(check_messages(context, f"contexts[{i}]"), add_generation_prompt=True,
                                            tokenize=True)
        contexts[i] = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        if candidates is not None and i < len(candidates) and isinstance(candidates[i], Sequence) and \
                not isinstance(candidates[i], (str, bytes)):  # a bare string: check_candidates refuses it
            candidates[i] = [tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str) else c
                             for c in candidates[i]]
    return contexts, candidates
