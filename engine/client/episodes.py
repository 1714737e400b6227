"""Multi-turn episodes of text environments with an LLM as the agent: a small environment protocol, and a runner
that steps N environments while the servers compute the other environments' actions.

An environment is any object with ``reset() -> (observation, info)`` and ``step(action)`` returning gymnasium's
``(observation, reward, terminated, truncated, info)`` or gym's older ``(observation, reward, done, info)``, with
text for observations and actions; ``info["admissible_actions"]`` lists the actions it accepts now, when it knows
them. Each episode needs its own environment object. :func:`run_episodes` plays one episode in each environment, each a
token-exact :class:`~llmrl.engine.client.trajectory.Trajectory` of chat turns, in one of two action modes:

- ``"choose"``: ``score`` the admissible actions (each followed by the token that ends the model's turn in the chat
  template: ChatML's ``<|im_end|>``, Gemma's ``<end_of_turn>``; else the EOS) and
  sample one from the softmax of their log-probs at ``temperature`` (as Lamorel and GLAM do; 0: the most likely
  one); the chosen action's ids and the model's per-token log-probs of them become the model's turn;
- ``"write"``: ``generate`` free text (``generate_kwargs``: ``max_new_tokens``, ``stop``...); the sample is the turn.

The environments are split in two halves: while the servers compute one half's actions (the ``*_async`` futures),
the other half's environments step. Every episode ends when its environment says done, after ``max_turns``, or
when its next prompt would be longer than ``max_prompt_tokens`` (the model's context; ``truncated`` says which), or
when its environment fails: a ``step`` that raises, answers in another shape, with an observation that is not text
or a reward that is not finite, or (with ``step_timeout``) a ``step`` that has not returned within that many
seconds ends that episode alone, with ``Episode.error`` saying why (``cut_by`` is ``"error"``), and the others go
on; :func:`episode_batch` leaves it out. A step that timed out is left running on a daemon thread of its own (Python
cannot stop it) and its environment is never stepped again; a ``reset`` that has not returned within
``step_timeout`` raises TimeoutError from the call, as a failing ``reset`` raises its error. A
truncated episode's trajectory keeps the state it was cut in (the last observation and the next generation prompt:
what a critic bootstraps from); an ended one stops at the model's last turn.
Credit assignment: :func:`episode_batch` turns groups of episodes into an ``update`` of the multi-turn updaters
(``ppo_turns``, ``grpo_turns``); for client-owned steps, :meth:`Trajectory.datum` takes per-turn advantages, and
:func:`group_episode_advantages` gives GRPO's over a group of episodes from the same start.

``Caller.run_episodes`` calls :func:`run_episodes` with the Caller. This module drives the Caller; it computes no
loss and keeps no state between calls.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field

from llmrl.engine.client.trajectory import Trajectory
from llmrl.engine.log import logger

MODES = ("choose", "write")


@dataclass
class Episode:
    trajectory: Trajectory
    actions: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    done: bool = False
    truncated: bool = False  # cut short: by max_turns or max_prompt_tokens, or by the environment's `truncated`
    cut_by: str | None = None  # what cut it short: "max_turns", "max_prompt_tokens", "environment" or "error"
    error: str | None = None  # why the environment failed it (its step raised or answered malformed): not trained on
    _info: dict = field(default_factory=dict, repr=False)  # the latest info (admissible actions)

    @property
    def total_reward(self) -> float:
        return sum(self.rewards)


def run_episodes(caller, envs, *, mode: str = "write", max_turns: int = 10, system: str | None = None,
                 llm: str | None = None, peft_adapter: str | None = None, temperature: float = 1.0, seed: int = 0,
                 generate_kwargs: dict | None = None, max_prompt_tokens: int | None = None,
                 step_timeout: float | None = None) -> list[Episode]:
    """One episode in each of ``envs`` (see the module); returns them in the order of ``envs``. ``step_timeout``:
    seconds an environment's ``step`` may take before its episode ends with an error, and its ``reset`` before the call
    raises TimeoutError (None: no limit)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "choose" and generate_kwargs:
        raise ValueError("generate_kwargs set how mode 'write' generates; mode 'choose' scores the admissible actions "
                         "and generates nothing: drop them, or use mode 'write'")
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
    if not envs:
        raise ValueError("run_episodes needs at least one environment")
    seen: dict[int, int] = {}
    for i, env in enumerate(envs):
        if id(env) in seen:
            raise ValueError(f"envs[{i}] is the same object as envs[{seen[id(env)]}]: each episode steps its own "
                             "environment (make one per episode, e.g. [make_env() for _ in range(n)])")
        seen[id(env)] = i
    if step_timeout is not None and not (isinstance(step_timeout, (int, float)) and not isinstance(step_timeout, bool)
                                         and math.isfinite(step_timeout) and step_timeout > 0):
        raise ValueError(f"step_timeout must be a number of seconds > 0 (None: no limit), got {step_timeout!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: the most likely action, greedy decoding), got {temperature!r}")
    tokenizer = caller.get_tokenizer(llm)
    rng = random.Random(seed)
    episodes = []
    for i, env in enumerate(envs):
        observation, info = _within(functools.partial(_reset, env, i), step_timeout, f"envs[{i}].reset()")
        start = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]
        episodes.append(Episode(Trajectory(tokenizer, start), _info=dict(info or {})))
    halves = [list(range(0, len(envs), 2)), list(range(1, len(envs), 2))]

    def submit(indices: list[int]):
        for i in indices:  # an episode whose next prompt outgrows the limit ends here, truncated
            if not episodes[i].done and max_prompt_tokens is not None and \
                    len(episodes[i].trajectory.ids) > max_prompt_tokens:
                if not episodes[i].actions:
                    raise ValueError(f"environment {i}'s first prompt is {len(episodes[i].trajectory.ids)} tokens, "
                                     f"over max_prompt_tokens={max_prompt_tokens}")
                episodes[i].done = episodes[i].truncated = True
                episodes[i].cut_by = "max_prompt_tokens"
        active = [i for i in indices if not episodes[i].done]
        if not active:
            return None
        prompts = [episodes[i].trajectory.prompt for i in active]
        if mode == "write":
            kwargs = {"max_new_tokens": 32, "do_sample": temperature > 0, **(generate_kwargs or {})}
            if temperature > 0:
                kwargs.setdefault("temperature", temperature)
            future = caller.generate_async(prompts, llm=llm, peft_adapter=peft_adapter, seed=rng.randrange(2**31),
                                           **kwargs)
        else:
            ends = {i: _turn_end(episodes[i].trajectory) for i in active}
            candidates = [[tokenizer.encode(a, add_special_tokens=False) + ends[i] for a in _admissible(episodes[i], i)]
                          for i in active]
            future = caller.score_async(prompts, candidates, llm=llm, peft_adapter=peft_adapter, per_token=True)
        return active, future

    pending = {h: submit(half) for h, half in enumerate(halves) if half}
    while any(p is not None for p in pending.values()):
        for h in list(pending):
            if pending[h] is None:
                continue
            active, future = pending[h]
            for i, result in zip(active, future.result()):
                action, sample = (_written(result) if mode == "write" else
                                  _chosen(result, _admissible(episodes[i], i), temperature, rng))
                _play(envs[i], i, episodes[i], action, sample, max_turns, step_timeout)
            pending[h] = submit(halves[h])  # this half's next actions compute while the other half steps
    return episodes


def _turn_end(trajectory) -> list[int]:
    """What ends a chosen action, as the model would end it in write mode: the template's end-of-turn token
    (Gemma's ``<end_of_turn>``, not its EOS), else the EOS."""
    end = trajectory.end_of_turn_id()
    return [] if end is None else [end]


def _admissible(episode: Episode, index: int) -> list[str]:
    actions = episode._info.get("admissible_actions")
    if not actions:
        raise ValueError(f"mode 'choose' scores the admissible actions, but environment {index} gave none "
                         "(info['admissible_actions']): use mode 'write', or list them")
    return [str(a) for a in actions]


def _written(samples: list[dict]) -> tuple[str, dict]:
    sample = samples[0]
    return sample["text"].strip(), sample


def _chosen(result: dict, actions: list[str], temperature: float, rng: random.Random) -> tuple[str, dict]:
    scores = [float(s) for s in result["score"]]
    if temperature == 0:
        k = max(range(len(actions)), key=scores.__getitem__)
    else:
        top = max(scores)
        k = rng.choices(range(len(actions)), weights=[math.exp((s - top) / temperature) for s in scores])[0]
    return actions[k], {"tokens": result["tokens"][k].tolist(), "logprobs": result["logprobs"][k].tolist()}


def _reset(env, index: int):
    result = env.reset()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"envs[{index}].reset() must return (observation, info), as gymnasium's does; got "
                        f"{type(result).__name__}{f' of {len(result)}' if isinstance(result, tuple) else ''}")
    return result


def _within(call, timeout: float | None, what: str):
    """``call()``, on a daemon thread of its own when ``timeout`` is set: TimeoutError naming ``what`` if it has not
    returned by then (the thread is left to finish, or not, on its own)."""
    if timeout is None:
        return call()
    import threading

    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
            outcome.append((False, err))

    thread = threading.Thread(target=run, name=f"llmrl-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise TimeoutError(f"{what} did not return within {timeout:g} s (step_timeout); the environment is left to "
                           "its thread and not stepped again")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _step(env, index: int, action: str) -> tuple:
    """``env.step(action)`` as ``(observation, reward, terminated, truncated, info)``; raises naming the environment
    when it answers in another shape, with an observation that is not text or a reward that is not finite."""
    result = env.step(action)
    if isinstance(result, tuple) and len(result) == 5:  # gymnasium
        observation, reward, terminated, cut, info = result
    elif isinstance(result, tuple) and len(result) == 4:  # gym before 0.26
        (observation, reward, terminated, info), cut = result, False
    else:
        raise TypeError(f"envs[{index}].step() must return (observation, reward, terminated, truncated, info) or "
                        f"(observation, reward, done, info); got {type(result).__name__}"
                        f"{f' of {len(result)}' if isinstance(result, tuple) else ''}")
    if not terminated and not isinstance(observation, str):
        raise TypeError(f"envs[{index}].step() returned an observation of type {type(observation).__name__}; "
                        "observations are text")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"envs[{index}].step() returned the reward {reward}, which is not finite")
    return observation, reward, terminated, cut, info


def _play(env, index: int, episode: Episode, action: str, sample: dict, max_turns: int,
          step_timeout: float | None = None) -> None:
    episode.trajectory.add_sample(sample)
    try:
        observation, reward, terminated, cut, info = _within(functools.partial(_step, env, index, action),
                                                             step_timeout, f"envs[{index}].step()")
    except Exception as err:  # noqa: BLE001 - this episode ends with the error; the others go on
        episode.error = f"{type(err).__name__}: {err}"
        episode.actions.append(action)
        episode.rewards.append(0.0)
        episode.infos.append({"error": episode.error})
        episode.done = episode.truncated = True
        episode.cut_by = "error"
        logger.warning(f"environment {index} failed at turn {len(episode.actions)}; its episode ends here and is "
                       f"left out of episode_batch ({episode.error})")
        return
    episode.actions.append(action)
    episode.rewards.append(reward)
    episode.infos.append(dict(info or {}))
    episode._info = dict(info or {})
    episode.done = bool(terminated) or bool(cut) or len(episode.actions) >= max_turns
    episode.truncated = episode.done and not terminated
    episode.cut_by = ("environment" if cut else "max_turns") if episode.truncated else None
    if not terminated:  # a truncated episode keeps the state it was cut in: a critic's value of it bootstraps
        episode.trajectory.add_message(observation)


def group_episode_advantages(episodes, gamma: float = 1.0, scale: bool = True, eps: float = 1e-4
                             ) -> list[list[float]]:
    """GRPO over episodes from the same start: each episode's ``(G - mean) / (std + eps)`` over the group's
    discounted returns (``scale=False``: centred only), repeated for each of its turns; for client-owned steps
    (:meth:`Trajectory.datum`). This adapts :class:`Episode` objects to the one implementation,
    :func:`llmrl.engine.episode_returns.group_episode_advantages` (the one ``grpo_turns`` uses, on reward tensors)."""
    import torch

    from llmrl.engine.episode_returns import group_episode_advantages as advantages

    rewards = [torch.tensor([float(r) for r in e.rewards], dtype=torch.float64) for e in episodes]
    return [a.tolist() for a in advantages(rewards, gamma, scale, eps)]


def episode_batch(groups, bootstrap: bool = False) -> dict:
    """The keyword arguments of ``caller.update(**episode_batch(groups))`` for ``ppo_turns`` and ``grpo_turns``:
    ``groups`` is a list of groups, each a list of :class:`Episode` played from the same start (one episode per
    group is fine for ``ppo_turns``; ``grpo_turns`` needs two or more). Per group: the context is the start's ids,
    the candidates are each episode's ids after it up to its last model token (an observation after it carries no
    loss), with its ``model_mask``, ``turn_rewards`` and ``old_logprobs`` (the log-probs its tokens were sampled
    with). Refuses a group whose episodes do not share their start ids, and an
    episode whose numbers of turns and rewards differ. An episode whose environment failed (``Episode.error``) is
    left out, with a warning saying how many were; a group left with none is dropped.

    ``bootstrap=True`` (``ppo_turns``): a truncated episode's candidate goes on to the state it was cut in (the
    last observation and the next generation prompt, which its trajectory keeps) and one placeholder token, where
    the critic's value of that state is read; the ``bootstrap`` argument marks these episodes. An episode cut by
    ``max_prompt_tokens`` is not bootstrapped (that state is longer than the model should read): it ends at its last
    turn, with the value 0 after it.

    When every turn's sample carried its ``policy_version`` (``generate``'s samples do), ``policy_versions`` holds
    them, per group, per episode, per turn: ``update`` reports their staleness (see
    :mod:`llmrl.engine.policy_versions`)."""
    contexts, candidates, masks, rewards, old, flags, versions = [], [], [], [], [], [], []
    failed = sum(ep.error is not None for group in groups for ep in group)
    if failed:
        logger.warning(f"episode_batch leaves out {failed} episode(s) whose environment failed (Episode.error)")
        groups = [kept for kept in ([ep for ep in group if ep.error is None] for group in groups) if kept]
        if not groups:
            raise ValueError("every episode's environment failed (Episode.error): there is nothing to train on")
    for g, group in enumerate(groups):
        if not group:
            raise ValueError(f"group {g} holds no episode")
        starts = []
        for e, episode in enumerate(group):
            trajectory = episode.trajectory
            if not trajectory.turns:
                raise ValueError(f"episode {e} of group {g} has no model turn")
            if len(trajectory.turns) != len(episode.rewards):
                raise ValueError(f"episode {e} of group {g} has {len(trajectory.turns)} model turns but "
                                 f"{len(episode.rewards)} rewards: one reward per turn")
            starts.append(trajectory.ids[:trajectory.turns[0].start])
        if any(s != starts[0] for s in starts):
            raise ValueError(f"the episodes of group {g} start from different ids: a group shares one start (the "
                             "same first prompt)")
        cut = len(starts[0])
        ends = [ep.trajectory.turns[-1].end for ep in group]  # what follows the last turn carries no loss: left out
        cuts = [bootstrap and ep.truncated and ep.cut_by != "max_prompt_tokens" for ep in group]
        for e, (episode, end, truncated) in enumerate(zip(group, ends, cuts)):
            if truncated and len(episode.trajectory.ids) == end:
                raise ValueError(f"episode {e} of group {g} is truncated, but its trajectory stops at its last turn: "
                                 "the state it was cut in is unknown (episodes of run_episodes keep it; add the last "
                                 "observation with trajectory.add_message), or build the batch without bootstrap")
        ends = [len(ep.trajectory.ids) if truncated else end for ep, end, truncated in zip(group, ends, cuts)]
        tails = [[_placeholder(ep.trajectory)] if truncated else [] for ep, truncated in zip(group, cuts)]
        contexts.append(starts[0])
        candidates.append([ep.trajectory.ids[cut:end] + tail for ep, end, tail in zip(group, ends, tails)])
        masks.append([[int(m) for m in ep.trajectory.model_mask[cut:end]] + [0] * len(tail)
                      for ep, end, tail in zip(group, ends, tails)])
        rewards.append([[float(r) for r in ep.rewards] for ep in group])
        old.append([ep.trajectory.sampling_logprobs[cut:end] + [0.0] * len(tail)
                    for ep, end, tail in zip(group, ends, tails)])
        flags.append([int(truncated) for truncated in cuts])
        versions.append([ep.trajectory.policy_versions for ep in group])
    batch = {"contexts": contexts, "candidates": candidates, "model_mask": masks, "turn_rewards": rewards,
             "old_logprobs": old}
    if bootstrap:
        batch["bootstrap"] = flags
    if all(v is not None for group in versions for episode in group for v in episode):
        batch["policy_versions"] = versions
    return batch


def _placeholder(trajectory) -> int:
    """The token after a truncated episode's last state: the position where the critic's value of that state is
    read (a token-level value is read from the hidden state before its token, so which token it is does not matter)."""
    eos = trajectory.tokenizer.eos_token_id
    return int(eos) if eos is not None else 0
