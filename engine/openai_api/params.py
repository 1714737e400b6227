"""The OpenAI request bodies read as typed requests: every field checked, each refusal a 400 naming the field.

``/v1/chat/completions`` and ``/v1/completions`` bodies become a :class:`ChatRequest` or a :class:`CompletionRequest`
holding a :class:`Sampling` (the ``generate`` arguments it maps to: :meth:`Sampling.generate_kwargs`). What the
endpoint honours: ``temperature`` (0: greedy decoding, one decoding copied to each of ``n``), ``top_p``,
``max_tokens`` / ``max_completion_tokens``, ``stop`` (up to 4 strings), ``n``, ``seed``, ``logprobs`` (the sampled
tokens' own; no alternatives), ``stream``, ``user`` (the rollout id), ``tools`` with ``tool_choice: "auto"``. A field
the endpoint knows but does not honour (a penalty, ``logit_bias``, ``response_format``, ``top_logprobs`` > 0...) is
accepted only at its no-op value (unset, 0, empty); any other value is refused, as is an unknown field: never
answered as if it had been applied. Sampling keeps the model's own distribution: ``top_k`` is off (Hugging Face's
default of 50 would cut it).

This module checks and maps fields; it calls nothing (:mod:`llmrl.engine.openai_api.service` does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_N = 128  # choices of one request
MAX_STOPS = 4  # OpenAI's own limit
UNSET_MAX_TOKENS = 4096  # new tokens when the request sets none (and the model's length leaves more room)
ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields the endpoint knows and does not honour: accepted only at these no-op values (unset is always accepted).
NO_OP = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "top_logprobs": (0,),
    "response_format": ({"type": "text"},), "store": (False,), "metadata": ({},), "stream_options": ({},),
    "parallel_tool_calls": (True,), "service_tier": ("auto", "default"), "echo": (False,), "suffix": ("",),
    "best_of": (1,), "functions": ([],), "function_call": ("none",), "modalities": (["text"],),
    "reasoning_effort": (), "prediction": (), "audio": (), "web_search_options": (),
}
HINTS = {
    "presence_penalty": "llmrl samples from the model's own distribution (its log-probs train the policy)",
    "frequency_penalty": "llmrl samples from the model's own distribution (its log-probs train the policy)",
    "logit_bias": "llmrl samples from the model's own distribution (its log-probs train the policy)",
    "top_logprobs": "the endpoint returns the sampled tokens' log-probs only (logprobs: true)",
    "response_format": "constrained decoding is not served: ask for the format in the messages",
    "functions": "give tools (the deprecated functions field is not read)",
    "function_call": "give tools with tool_choice 'auto'",
    "best_of": "send n and pick among the choices yourself",
    "echo": "the prompt's ids are captured under the rollout id",
    "stream_options": "the stream carries no usage chunk",
}
CHAT_FIELDS = {"model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
               "logprobs", "stream", "user", "tools", "tool_choice", *NO_OP}
COMPLETION_FIELDS = {"model", "prompt", "temperature", "top_p", "max_tokens", "stop", "n", "seed", "logprobs",
                     "stream", "user", *NO_OP}


class Refused(Exception):
    """A request the endpoint answers with ``status`` (400 by default) and an OpenAI error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int | None  # None: as many as the model's length leaves (at most UNSET_MAX_TOKENS)
    stop: tuple[str, ...]
    n: int
    seed: int | None
    logprobs: bool

    def generate_kwargs(self, room: int | None) -> dict:
        """``Caller.generate`` keyword arguments (``seed`` included); ``room``: the new tokens the model's maximum
        length leaves after the prompt. Greedy decoding asks for one sequence (the service copies it)."""
        if room is not None and room < 1:
            raise Refused("the prompt fills the model's whole length: shorten the conversation", "messages")
        bound = UNSET_MAX_TOKENS if room is None else min(room, UNSET_MAX_TOKENS)
        greedy = self.temperature == 0
        kwargs = {"max_new_tokens": bound if self.max_tokens is None else self.max_tokens,
                  "do_sample": not greedy, "num_return_sequences": 1 if greedy else self.n, "seed": self.seed}
        if not greedy:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=0)
        if self.stop:
            kwargs["stop"] = list(self.stop)
        return kwargs


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]
    tools: list[dict] | None
    sampling: Sampling
    user: str | None
    stream: bool


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    user: str | None
    stream: bool


def chat_request(body: dict) -> ChatRequest:
    """The checked request of a ``/v1/chat/completions`` body."""
    _check_fields(body, CHAT_FIELDS, "chat.completions")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise Refused(f"logprobs must be true or false here, got {body['logprobs']!r} (top_logprobs: 0)", "logprobs")
    tokens = body.get("max_completion_tokens")
    if tokens is not None and body.get("max_tokens") is not None and tokens != body["max_tokens"]:
        raise Refused("give max_completion_tokens or max_tokens, not both", "max_completion_tokens")
    choice = body.get("tool_choice")
    if choice not in (None, "auto") and not (choice == "none" and not body.get("tools")):
        raise Refused(f"tool_choice {choice!r} is not honoured: the model chooses (tool_choice 'auto', or leave it "
                      "unset)", "tool_choice")
    return ChatRequest(_model(body), messages(body.get("messages")), tools(body.get("tools")),
                       _sampling(body, "max_completion_tokens" if tokens is not None else "max_tokens",
                                 bool(body.get("logprobs"))), _user(body), _flag(body, "stream"))


def completion_request(body: dict) -> CompletionRequest:
    """The checked request of a ``/v1/completions`` body: one prompt, a string or token ids."""
    _check_fields(body, COMPLETION_FIELDS, "completions")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not (ids and prompt):
        raise Refused("prompt must be one non-empty string or one list of token ids (send one request per prompt)",
                      "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) and logprobs is not True:
        raise Refused(f"logprobs {logprobs!r}: only 0 is served (the sampled tokens' own log-probs, no alternatives)",
                      "logprobs")
    return CompletionRequest(_model(body), prompt, _sampling(body, "max_tokens", logprobs is not None), _user(body),
                             _flag(body, "stream"))


def messages(value) -> list[dict]:
    """OpenAI's messages as the chat template reads them: text parts joined, ``developer`` read as ``system``, a
    tool call's JSON ``arguments`` as a mapping (Hugging Face's templates render mappings)."""
    if not isinstance(value, list) or not value:
        raise Refused("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for k, message in enumerate(value):
        where = f"messages[{k}]"
        if not isinstance(message, dict):
            raise Refused(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise Refused(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        message = {**message, "role": "system" if role == "developer" else role,
                   "content": _content(message.get("content"), where, bool(message.get("tool_calls")))}
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(message)
    return out


def tools(value) -> list[dict] | None:
    """The request's function tools, as given (the chat template renders their JSON schemas); None when none."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise Refused("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise Refused(f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                          f"tools[{k}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise Refused(f"tools[{k}].function.name must be a non-empty string", f"tools[{k}].function.name")
    return value


def _check_fields(body: dict, known: set[str], route: str) -> None:
    for name in body:
        if name not in known:
            raise Refused(f"unknown field {name!r} for {route}: llmrl's endpoint reads "
                          f"{', '.join(sorted(known - set(NO_OP)))}", name)
    for name, allowed in NO_OP.items():
        if name in body and body[name] is not None and body[name] not in allowed:
            shown = ", ".join(repr(v) for v in allowed) or "unset"
            hint = HINTS.get(name, "llmrl's endpoint does not apply it")
            raise Refused(f"{name}={body[name]!r} is not honoured ({hint}): leave it unset ({shown})", name)


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Refused("model must name one of the endpoint's LLMs (GET /v1/models lists them)", "model")
    return model


def _user(body: dict) -> str | None:
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or not user):
        raise Refused("user must be a non-empty string (the rollout id the call is captured under)", "user")
    return user


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise Refused(f"{name} must be true or false, got {value!r}", name)
    return bool(value)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise Refused(f"{name} must be a number from {low:g} to {high:g}, got {value!r}", name)
    return float(value)


def _count(body: dict, name: str, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise Refused(f"{name} must be an integer {bound}, got {value!r}", name)
    return value


def _sampling(body: dict, max_name: str, logprobs: bool) -> Sampling:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise Refused(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them, got "
                      f"{body.get('stop')!r}", "stop")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise Refused("top_p must be above 0 (for greedy decoding, set temperature 0)", "top_p")
    return Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p,
                    max_tokens=_count(body, max_name, 1, None), stop=tuple(stop), n=_count(body, "n", 1, MAX_N) or 1,
                    seed=_count(body, "seed", -(2**62), 2**62 - 1), logprobs=logprobs)


def _content(content, where: str, has_calls: bool):
    """A message's text: a string, text parts joined, or None beside tool calls."""
    if isinstance(content, str) or (content is None and has_calls):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Refused(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}: llmrl serves "
                              "text models", f"{where}.content[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise Refused(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                  f"{where}.content")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise Refused(f"{where} must be a list of tool calls", where)
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Refused(f"{where}[{k}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                          f"{where}[{k}]")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as err:
                raise Refused(f"{where}[{k}].function.arguments is not JSON ({err})",
                              f"{where}[{k}].function.arguments") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out
