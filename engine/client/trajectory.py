"""Token-exact multi-turn trajectories: one episode's token ids, turn by turn, never re-tokenised.

A :class:`Trajectory` starts from a prompt (chat messages, rendered once with the chat template and its generation
prompt, or token ids). Then, turn after turn:

- :meth:`Trajectory.add_sample` appends the ids the model sampled (a ``generate`` sample), exactly, with their
  log-probs under the distribution they were sampled from (``sampling_logprobs``, after temperature and top-k: an
  importance ratio's denominator) and under the model (``model_logprobs``): these are the trajectory's *model
  tokens*, the only ones a loss trains on;
- :meth:`Trajectory.add_message` appends the environment's reply as a chat message. Only the new message is
  formatted: the template renders a conversation with and without it, and the ids of the difference, plus whatever
  closes the model's turn that the model did not emit (ChatML's ``\\n`` after ``<|im_end|>``, or the whole closing
  when the sample was cut at ``max_new_tokens`` or a stop string), are tokenised on their own and appended;
- :meth:`Trajectory.add_ids` appends other ids as given (a tool's output already tokenised).

:attr:`Trajectory.prompt` is the next ``generate`` input: by construction every prompt extends the previous one.
A sample does not say which prompt it was generated from: add each one to the trajectory whose prompt produced it.
Two messages in a row (a tool's output, then the user's) are one environment turn: the generation prompt the
first one ended with is replaced by the second message, as the template renders them. :meth:`Trajectory.datum`
gives the whole episode as one Tinker-style datum for ``forward_backward`` (per-turn or per-token advantages on
the model's tokens, zero on the environment's). Each turn keeps its sample's ``policy_version`` (the weights it was
drawn from, :mod:`llmrl.engine.policy_versions`): :attr:`Trajectory.policy_versions`.

The formatting of one new message assumes what chat templates do: a conversation's rendering is a prefix of the
rendering of the conversation with one more message, and a message's own text starts at a special token (so that
tokenising it alone gives the ids it has in the whole). Both are checked on each message; a template that breaks
them is refused with the message at fault. This module runs on the client and calls no server.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmrl.engine.client.chat import check_messages

_PROBE = "\x00llmrl-probe\x00"  # a content no real message holds: where a rendered message's text sits


@dataclass(frozen=True)
class Turn:
    start: int  # index of the turn's first model token in Trajectory.ids
    end: int  # one past its last
    policy_version: int | None = None  # the sample's policy_version (None: the sample carried none)


class Trajectory:
    """One episode's ids: the prompt, then the model's samples and the environment's messages (see the module)."""

    def __init__(self, tokenizer, start):
        self.tokenizer = tokenizer
        self.messages: list[dict] | None = None
        if isinstance(start, str):
            start = tokenizer.encode(start)
        elif start and isinstance(start[0], dict):
            self.messages = check_messages(start, "start")
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("a trajectory started from chat messages needs a tokenizer with a chat template, and "
                                 "this one has none: set tokenizer.chat_template (the Caller's tokenizer is the "
                                 "client's own copy), or start from token ids")
            start = _ids(tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True))
        self.ids: list[int] = [int(t) for t in start]
        self.model_mask: list[bool] = [False] * len(self.ids)
        self.sampling_logprobs: list[float] = [0.0] * len(self.ids)  # under the distribution sampled from
        self.model_logprobs: list[float] = [0.0] * len(self.ids)  # the model's raw log-probs (generate's logprobs)
        self.turns: list[Turn] = []
        self._closed = True  # whether the model's last turn is closed (the template's end-of-turn text is present)
        self._prompted = self.messages is not None  # whether the ids end with the template's generation prompt
        self._ended_by: int | None = None  # the special token that ended the last sample (EOS, an end of turn)

    @property
    def prompt(self) -> list[int]:
        """The ids to generate the next turn from."""
        return list(self.ids)

    @property
    def policy_versions(self) -> list[int | None]:
        """Per model turn, the ``policy_version`` of the sample it holds (None where the sample carried none)."""
        return [turn.policy_version for turn in self.turns]

    def add_sample(self, sample: dict) -> Turn:
        """Append a ``generate`` sample's ids (exactly as sampled) as the model's turn."""
        tokens = [int(t) for t in _list(sample["tokens"])]
        raw = _list(sample.get("logprobs"))
        sampled = _list(sample.get("sampling_logprobs")) or raw
        for name, values in (("logprobs", raw), ("sampling_logprobs", sampled)):
            if values is not None and len(values) != len(tokens):
                raise ValueError(f"the sample has {len(tokens)} tokens but {len(values)} {name}")
        start = len(self.ids)
        self.ids += tokens
        self.model_mask += [True] * len(tokens)
        self.sampling_logprobs += [float(x) for x in sampled] if sampled is not None else [0.0] * len(tokens)
        self.model_logprobs += [float(x) for x in raw] if raw is not None else [0.0] * len(tokens)
        version = sample.get("policy_version")
        turn = Turn(start, len(self.ids), None if version is None else int(version))
        self.turns.append(turn)
        self._closed, self._prompted = False, False
        self._ended_by = tokens[-1] if tokens and tokens[-1] in _special_ids(self.tokenizer) else None
        if self.messages is not None:
            self.messages.append({"role": "assistant", "content": self.tokenizer.decode(tokens,
                                                                                       skip_special_tokens=True)})
        return turn

    def add_message(self, content, role: str = "user", **fields) -> list[int]:
        """Append the environment's reply as a chat message (and the next generation prompt); returns its ids.
        ``fields`` are the message's other keys for the template (``name``, ``tool_call_id``...)."""
        if self.messages is None:
            raise ValueError("add_message needs a trajectory started from chat messages; use add_ids for others")
        message = check_messages([{**fields, "role": role, "content": content}], "message")[0]
        keep = len(self.ids) - (self._generation_prompt_length() if self._prompted else 0)  # it gives way
        text = self._closing_text() + self._message_text(message)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        # the boundary: the last ids' text followed by the new text must end with the new text's own ids
        joint = self.tokenizer.encode(self.tokenizer.decode(self.ids[max(0, keep - 4):keep]) + text,
                                      add_special_tokens=False)
        if joint[len(joint) - len(ids):] != ids:
            raise ValueError(f"message {message!r} does not start at a token boundary of the chat template (its ids "
                             "alone differ from its ids after the conversation): build the prompt's ids yourself and "
                             "use add_ids")
        for values in (self.ids, self.model_mask, self.sampling_logprobs, self.model_logprobs):  # checked: now change
            del values[keep:]
        self.messages.append(message)
        added = self.add_ids(ids)
        self._closed, self._prompted = True, True
        return added

    def end_of_turn_id(self) -> int | None:
        """The token that ends the model's turn: the special token the template's closing of an assistant message
        starts with (ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``), or the tokenizer's EOS (a trajectory
        started from ids, or a template whose closing starts with plain text)."""
        if self.messages is not None:
            closing = self.tokenizer.encode(self._assistant_closing(self.messages), add_special_tokens=False)
            if closing and closing[0] in _special_ids(self.tokenizer):
                return closing[0]
        return self.tokenizer.eos_token_id

    def add_ids(self, ids) -> list[int]:
        """Append ids the model did not sample (an observation), exactly as given."""
        ids = [int(t) for t in ids]
        self._prompted = False  # whatever they hold, they are the trajectory's last ids now
        self.ids += ids
        self.model_mask += [False] * len(ids)
        self.sampling_logprobs += [0.0] * len(ids)
        self.model_logprobs += [0.0] * len(ids)
        return ids

    def datum(self, advantages, logprobs_elsewhere=None) -> dict:
        """The episode as one datum for ``forward_backward`` (``importance_sampling``, ``ppo``, ``cispo``...):
        ``advantages`` is one number per turn (spread over the turn's tokens) or one per id of :attr:`ids`;
        environment tokens get advantage 0, and the sampler's log-probs are the ones recorded (0 where the model did
        not write). ``dro``'s penalty ``beta / 2 * (lp - logprobs)^2`` reads every position, so those zeros would
        pull the prompt's and the environment's tokens towards probability 1: for ``dro`` give
        ``logprobs_elsewhere``, one log-prob per target token (``forward([datum])``'s ``logprobs`` fit as they
        are), used where the model did not write."""
        per_token = [0.0] * len(self.ids)
        if len(advantages) == len(self.turns):
            for turn, value in zip(self.turns, advantages):
                per_token[turn.start:turn.end] = [float(value)] * (turn.end - turn.start)
        elif len(advantages) == len(self.ids):
            per_token = [float(a) if m else 0.0 for a, m in zip(advantages, self.model_mask)]
        else:
            raise ValueError(f"advantages has {len(advantages)} values: give one per turn ({len(self.turns)}) or "
                             f"one per token ({len(self.ids)})")
        logprobs = self.sampling_logprobs[1:]
        if logprobs_elsewhere is not None:
            given = [float(x) for x in logprobs_elsewhere]
            if len(given) != len(logprobs):
                raise ValueError(f"logprobs_elsewhere has {len(given)} values: give one per target token "
                                 f"({len(logprobs)}, the ids but the first)")
            logprobs = [lp if wrote else other for lp, wrote, other in zip(logprobs, self.model_mask[1:], given)]
        return {"model_input": self.ids[:-1], "loss_fn_inputs": {
            "target_tokens": self.ids[1:], "advantages": per_token[1:], "logprobs": logprobs}}

    # ------------------------------------------------------------------ formatting one message

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _closing_text(self) -> str:
        """What closes the model's last turn in the template that the model did not emit."""
        if self._closed:
            return ""
        closing = self._assistant_closing(self.messages[:-1])
        if self._ended_by is not None:  # the model emitted the closing's first token (ChatML's <|im_end|>, Gemma's
            ended = self.tokenizer.decode([self._ended_by])  # <end_of_turn>): only the rest is missing
            if ended and closing.startswith(ended):
                return closing[len(ended):]
        return closing

    def _assistant_closing(self, history: list[dict]) -> str:
        """The template's text after an assistant message's content, following ``history``."""
        probe = self._render(history + [{"role": "assistant", "content": _PROBE}], False)
        return probe[probe.index(_PROBE) + len(_PROBE):]

    def _generation_prompt_length(self) -> int:
        """How many ids at the end are the generation prompt (the last message's, or the start's), which a next
        message replaces; raises ValueError when the ids do not end with it."""
        with_prompt, without = self._render(self.messages, True), self._render(self.messages, False)
        prompt = self.tokenizer.encode(with_prompt[len(without):], add_special_tokens=False)
        if not with_prompt.startswith(without) or self.ids[len(self.ids) - len(prompt):] != prompt:
            raise ValueError("the trajectory ends with ids that are not the chat template's generation prompt, so a "
                             "second message cannot follow the first: build the prompt's ids yourself and use add_ids")
        return len(prompt)

    def _message_text(self, message: dict) -> str:
        """The template's text for ``message`` and the generation prompt after it, given the conversation so far."""
        history = self.messages
        before = self._render(history, False)
        after = self._render(history + [message], True)
        if not after.startswith(before):
            raise ValueError(f"the chat template renders the conversation differently once message {message!r} is "
                             "added (its rendering is not an extension): build the prompt's ids yourself and use "
                             "add_ids")
        return after[len(before):]


def _special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: its named ones (EOS...) and added tokens marked special (an end of turn)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, token in added.items() if getattr(token, "special", False)}


def _ids(value) -> list[int]:
    return list(value["input_ids"] if hasattr(value, "keys") else value)


def _list(value):
    return value.tolist() if hasattr(value, "tolist") else (None if value is None else list(value))
