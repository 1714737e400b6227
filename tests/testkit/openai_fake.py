"""A stand-in for the Caller behind the OpenAI endpoint's unit tests: :class:`ScriptedCaller` answers ``generate``
with the token ids the test scripts (each with made-up log-probs) and records every call, so that a test checks what
the endpoint sent (the prompt's ids, the sampling arguments) and what it captured, against the tokenizer's own chat
template. Chat templates in ChatML for a tiny tokenizer whose ``<|im_start|>`` / ``<|im_end|>`` are special tokens
(``<|im_end|>`` its EOS): plain, one that renders tools (Qwen 2.5's ``<tool_call>`` format), and one that drops the
reasoning of earlier assistant turns (as Qwen3's does)."""

from __future__ import annotations

import http.client
import json
from collections import deque

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = ("{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{- '\n' + (tool | "
         "tojson) }}{%- endfor %}{{- '\n</tools>\nCall a function as <tool_call>{\"name\": ..., \"arguments\": ...}"
         "</tool_call><|im_end|>\n' }}{%- endif %}" + CHATML)
DROPS_REASONING = ("{% for m in messages %}{% set text = m['content'].split('</think>')[-1] if m['role'] == "
                   "'assistant' else m['content'] %}{{ '<|im_start|>' + m['role'] + '\n' + text + '<|im_end|>\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_tokenizer(path: str, template: str = CHATML):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


def rendered(tokenizer, messages, tools=None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class ScriptedCaller:
    """``generate`` answers each call with the next scripted replies (texts, encoded with ``<|im_end|>`` after, or
    id lists), one per returned sequence; ``calls`` holds ``(contexts, kwargs)`` of every call."""

    def __init__(self, tokenizer, llms=("main",)):
        self.tokenizer = tokenizer
        self.llms = list(llms)
        self.info = {name: {"vocab_size": len(tokenizer), "max_length": 1024} for name in llms}
        self.replies: deque = deque()
        self.calls: list[tuple] = []

    def get_tokenizer(self, llm=None):
        return self.tokenizer

    def ids(self, reply) -> list[int]:
        if isinstance(reply, str):
            return self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return list(reply)

    def generate(self, contexts, *, llm=None, seed=None, **kwargs):
        self.calls.append((contexts, {"llm": llm, "seed": seed, **kwargs}))
        out = []
        for _ in contexts:
            samples = []
            for _ in range(kwargs.get("num_return_sequences", 1)):
                tokens = self.ids(self.replies.popleft())
                ends = tokens[-1] == self.tokenizer.eos_token_id
                samples.append({"tokens": tokens, "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
                                "logprobs": [-1.0 - k / 10 for k in range(len(tokens))],
                                "sampling_logprobs": [-0.5 - k / 10 for k in range(len(tokens))],
                                "stop_reason": "stop" if ends else "length", "stop": None})
            out.append(samples)
        return out


def post(base: str, path: str, body, key: str, headers: dict | None = None) -> tuple[int, dict | str]:
    """``(status, JSON answer)`` of a POST to the endpoint (the raw text for a stream)."""
    host, port = base.split("//", 1)[1].split("/", 1)[0].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers={"Authorization": f"Bearer {key}",
                                                         "Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    raw = response.read().decode()
    connection.close()
    kind = response.getheader("Content-Type") or ""
    return response.status, json.loads(raw) if kind.startswith("application/json") else raw
