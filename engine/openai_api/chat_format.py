"""Chat messages in and out of the model's own format: the prompt rendered by the tokenizer's chat template (tools
included), and a completion read back as an assistant message (its text, its Hermes/Qwen-style tool calls).

- :func:`render` gives the prompt's token ids exactly as ``apply_chat_template(messages, tools=...,
  add_generation_prompt=True, tokenize=True)`` gives them. A request with tools whose template renders the same ids
  without them (a template that ignores tools) is refused: the model would never see the tools it is offered.
- :func:`read_completion` turns sampled ids into the message's ``content`` and, when the request gave tools and the
  template writes calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes, Qwen 2.5 and 3), its
  ``tool_calls`` in OpenAI's form. A call whose JSON does not parse, or a block cut before its end, stays text.

This module formats; it samples nothing and records nothing.
"""

from __future__ import annotations

import json
import re
import secrets

from llmrl.engine.openai_api.params import Refused

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def render(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt's ids under the tokenizer's chat template, its generation prompt added."""
    if not getattr(tokenizer, "chat_template", None):
        raise Refused("this model's tokenizer has no chat template: send a prompt to /v1/completions instead, or "
                      "serve a tokenizer with one (llms.<name>.tokenizer)", "messages")
    ids = _apply(tokenizer, messages, tools)
    if tools and ids == _apply(tokenizer, messages, None):
        raise Refused("this model's chat template ignores tools (the prompt is the same with and without them), so "
                      "the model would never see them: describe the tools in a message yourself, or serve a model "
                      "whose template renders tools", "tools")
    return ids


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError (a template's raise_exception), KeyError...
        raise Refused(f"the chat template refused these messages ({type(err).__name__}: {err})", "messages") from None
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def writes_tool_calls(tokenizer) -> bool:
    """Whether the template writes tool calls as ``<tool_call>`` JSON blocks (Hermes / Qwen style)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "<tool_call>" in template


def read_completion(tokenizer, tokens: list[int], stop: str | None, parse_calls: bool) -> tuple[str, list[dict]]:
    """``(content, tool_calls)`` of a completion's ids: the text without special tokens and cut before the stop
    string that ended it (as OpenAI returns it), and the tool calls found when ``parse_calls``."""
    text = _cut(tokenizer.decode(tokens, skip_special_tokens=True), stop)
    if not parse_calls:
        return text, []
    raw = _cut(tokenizer.decode(tokens, skip_special_tokens=False), stop)
    calls, kept = [], []
    for match in TOOL_CALL.finditer(raw):
        call = _call(match.group(1))
        if call is None:
            return text, []  # not a call the model finished: the text as it is
        calls.append(call)
        kept.append(match.span())
    if not calls:
        return text, []
    content = raw
    for start, end in reversed(kept):
        content = content[:start] + content[end:]
    for special in getattr(tokenizer, "all_special_tokens", []):
        content = content.replace(special, "")
    return content.strip(), calls


def _cut(text: str, stop: str | None) -> str:
    if isinstance(stop, str) and stop in text:
        return text[:text.rfind(stop)]
    return text


def _call(block: str) -> dict | None:
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
