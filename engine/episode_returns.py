"""Discounted returns over the turns of an episode, and GRPO's advantages over a group of episodes from the same
start: :func:`turn_returns` and :func:`group_episode_advantages`, pure functions of tensors.

At the engine's level because the client's episode helper
(:func:`llmrl.engine.client.episodes.group_episode_advantages`, which adapts :class:`Episode` objects to this one)
uses them as well as the ``grpo_turns`` updater; :mod:`llmrl.plugins.rl_math` re-exports them. Nothing here reads
an episode object, a batch or a request.
"""

from __future__ import annotations

import torch


def turn_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[K]`` each turn's discounted return from that turn on: ``G_k = r_k + gamma * G_(k+1)``."""
    out, running = torch.zeros(rewards.shape[0], dtype=torch.float64), 0.0
    for k in reversed(range(rewards.shape[0])):
        running = float(rewards[k]) + gamma * running
        out[k] = running
    return out


def group_episode_advantages(rewards: list[torch.Tensor], gamma: float = 1.0, scale: bool = True, eps: float = 1e-4
                             ) -> list[torch.Tensor]:
    """GRPO over a group of episodes from the same start: each episode's advantage ``(G - mean) / (std + eps)``
    (``scale=False``: ``G - mean``), ``G`` its discounted return ``sum_k gamma^k r_k`` and the mean and unbiased
    standard deviation the group's, given to every turn of the episode (``[K]`` per episode). With ``gamma < 1`` a
    shorter episode to the same rewards returns more. Episodes of equal returns get 0, whatever ``eps``: a turn's
    own return-to-go is not compared with the group's episode returns, which would give a later turn of equal
    episodes ``(G_k - G_0) / eps``."""
    if len(rewards) < 2 or any(r.numel() == 0 for r in rewards):
        raise ValueError("a GRPO group of episodes needs at least 2 episodes of at least one turn each")
    totals = torch.stack([turn_returns(r, gamma)[0] for r in rewards])
    centred = totals - totals.mean()
    values = centred / (totals.std() + eps) if scale else centred
    return [value.repeat(r.numel()) for value, r in zip(values, rewards)]
