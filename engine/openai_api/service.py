"""What each OpenAI call does on an llmrl run: a checked request (:mod:`llmrl.engine.openai_api.params`) becomes one
``Caller.generate`` call on token ids, its samples are recorded under the call's rollout id
(:mod:`llmrl.engine.openai_api.capture`), and the answer is OpenAI's JSON.

- ``chat_completions``: the messages (and tools) are rendered with the LLM's chat template on the client
  (:mod:`llmrl.engine.openai_api.chat_format`); each choice's message is the sample's text, without special tokens
  and cut before the stop string that ended it, and its tool calls when the request gave tools and the template
  writes Hermes/Qwen-style ``<tool_call>`` blocks (``finish_reason: "tool_calls"``).
- ``completions``: a string prompt is tokenised here (with the tokenizer's special tokens, as ``generate`` tokenises
  a string), token ids are used as given.
- ``logprobs``: each sampled token's log-probability under the distribution it was drawn from (``generate``'s
  ``sampling_logprobs``: after temperature and top-p), in OpenAI's chat or completions form; no alternatives.
- ``models``: the LLMs served (all of the run's still open, or the one the endpoint was given).

The rollout id is the ``X-Rollout-Id`` header, else the body's ``user`` (both given: they must agree); a call with
neither is answered and not captured. This module maps calls; HTTP is :mod:`llmrl.engine.openai_api.http`'s.
"""

from __future__ import annotations

import secrets
import threading
import time

from llmrl.engine.openai_api import chat_format
from llmrl.engine.openai_api.capture import DEFAULT_TIMEOUT, Captures
from llmrl.engine.openai_api.params import Refused, chat_request, completion_request


class OpenAIService:
    """The endpoint's calls on ``caller``: every open LLM of the run, or only ``llm``; rollouts kept ``timeout`` s
    after their last call."""

    def __init__(self, caller, llm: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        if llm is not None and llm not in caller.llms:
            raise ValueError(f"unknown llm {llm!r}; this run serves {', '.join(caller.llms)}")
        self.caller = caller
        self.llm = llm
        self.captures = Captures(timeout)
        self.created = int(time.time())
        # A fast tokenizer is not safe to use from several threads at once (its padding and truncation settings are
        # shared state: "Already borrowed"); rendering and decoding take a moment next to generate.
        self.tokenizing = threading.Lock()

    def served(self) -> list[str]:
        closed = getattr(getattr(self.caller, "_run", None), "closed_llms", set())
        return [self.llm] if self.llm else [name for name in self.caller.llms if name not in closed]

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": self.created,
                                            "owned_by": "llmrl"} for name in self.served()]}

    def tokenizer(self, llm: str):
        return self.caller.get_tokenizer(llm)

    def chat_completions(self, body: dict, rollout_header: str | None) -> dict:
        request = chat_request(body)
        llm = self._llm(request.model)
        tokenizer = self.tokenizer(llm)
        with self.tokenizing:
            prompt = chat_format.render(tokenizer, request.messages, request.tools)
        samples = self._generate(llm, prompt, request.sampling, _rollout(rollout_header, request.user))
        parse = request.tools is not None and chat_format.writes_tool_calls(tokenizer)
        with self.tokenizing:
            choices = [_chat_choice(tokenizer, k, sample, parse, request.sampling.logprobs)
                       for k, sample in enumerate(samples)]
        return _answer("chat.completion", llm, choices, len(prompt), samples)

    def completions(self, body: dict, rollout_header: str | None) -> dict:
        request = completion_request(body)
        llm = self._llm(request.model)
        tokenizer = self.tokenizer(llm)
        with self.tokenizing:
            prompt = tokenizer.encode(request.prompt) if isinstance(request.prompt, str) else list(request.prompt)
        samples = self._generate(llm, prompt, request.sampling, _rollout(rollout_header, request.user))
        with self.tokenizing:
            choices = [_completion_choice(tokenizer, k, sample, request.sampling.logprobs)
                       for k, sample in enumerate(samples)]
        return _answer("text_completion", llm, choices, len(prompt), samples)

    def _llm(self, model: str) -> str:
        served = self.served()
        if model not in served:
            raise Refused(f"model {model!r} is not served here; the endpoint serves {', '.join(served)}", "model", 404)
        return model

    def _generate(self, llm: str, prompt: list[int], sampling, rollout_id: str | None) -> list[dict]:
        """The request's samples (plain lists), ``n`` of them, recorded under ``rollout_id``."""
        vocabulary = (getattr(self.caller, "info", {}) or {}).get(llm, {})
        longest = vocabulary.get("max_length")
        size = vocabulary.get("vocab_size")
        if size is not None and any(t >= size for t in prompt):
            raise Refused(f"the prompt holds token ids outside the model's vocabulary of {size}", "prompt")
        kwargs = sampling.generate_kwargs(None if longest is None else longest - len(prompt))
        try:
            (samples,) = self.caller.generate([prompt], llm=llm, **kwargs)
        except (ValueError, TypeError) as err:  # InvalidArgument and a server's refusal of this input
            raise Refused(f"generate refused the request: {err}", None) from None
        samples = [_plain(s) for s in samples] * (sampling.n if len(samples) == 1 else 1)  # greedy: copied
        if rollout_id is not None:
            self.captures.record(rollout_id, llm, prompt, samples)
        return samples


def _rollout(header: str | None, user: str | None) -> str | None:
    if header is not None and user is not None and header != user:
        raise Refused(f"the X-Rollout-Id header ({header!r}) and the user field ({user!r}) name different rollouts: "
                      "give one, or the same id in both", "user")
    return header if header is not None else user


def _plain(sample: dict) -> dict:
    def values(x):
        return x.tolist() if hasattr(x, "tolist") else list(x)

    raw = values(sample["logprobs"])
    return {"tokens": [int(t) for t in values(sample["tokens"])], "logprobs": raw,
            "sampling_logprobs": values(sample["sampling_logprobs"]) if sample.get("sampling_logprobs") is not None
            else raw, "stop_reason": sample.get("stop_reason"), "stop": sample.get("stop")}


def _chat_choice(tokenizer, index: int, sample: dict, parse_calls: bool, logprobs: bool) -> dict:
    content, calls = chat_format.read_completion(tokenizer, sample["tokens"], sample.get("stop"), parse_calls)
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": index, "message": message, "finish_reason": "tool_calls" if calls else _finish(sample),
              "logprobs": None}
    if logprobs:
        choice["logprobs"] = {"content": [_token_logprob(tokenizer, t, lp) for t, lp in
                                          zip(sample["tokens"], sample["sampling_logprobs"])]}
    return choice


def _completion_choice(tokenizer, index: int, sample: dict, logprobs: bool) -> dict:
    text, _ = chat_format.read_completion(tokenizer, sample["tokens"], sample.get("stop"), False)
    choice = {"index": index, "text": text, "finish_reason": _finish(sample), "logprobs": None}
    if logprobs:
        choice["logprobs"] = _completion_logprobs(tokenizer, sample)
    return choice


def _finish(sample: dict) -> str:
    return "length" if sample.get("stop_reason") == "length" else "stop"


def _token_logprob(tokenizer, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token], skip_special_tokens=False)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode()), "top_logprobs": []}


def _completion_logprobs(tokenizer, sample: dict) -> dict:
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in sample["tokens"]]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in sample["sampling_logprobs"]],
            "top_logprobs": None, "text_offset": offsets}


def _answer(kind: str, llm: str, choices: list[dict], prompt_tokens: int, samples: list[dict]) -> dict:
    completion = sum(len(s["tokens"]) for s in samples)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind, "created": int(time.time()), "model": llm,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                          "total_tokens": prompt_tokens + completion}}
