"""The maths of the ``ilql`` updater: implicit language Q-learning (Snell et al., 2022, "Offline RL for Natural
Language Generation with Implicit Language Q Learning"), with trlX's loss terms and names.

Every function works on the flat per-token layout of :class:`~llmrl.plugins.contracts.ForwardOutputs`: the scored
tokens of candidate 0 in order, then those of candidate 1, and so on. Token ``t`` is the action taken in state
``s_t`` (the prompt and the tokens before it); a continuation's last token leads to a terminal state, whose value
is 0.

It reads no batch and calls no model (:mod:`llmrl.plugins.ilql` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ILQLTerms:
    """Per-token loss terms, ``[n_tokens]`` each; their weighted sum is the loss (see :func:`ilql_losses`)."""

    q: torch.Tensor  # sum over the Q heads of (Q_i(s_t, a_t) - (r_t + gamma V(s_t+1)))^2
    v: torch.Tensor  # expectile regression of V(s_t) on min_i targetQ_i(s_t, a_t)
    cql: torch.Tensor  # sum over the Q heads of the cross-entropy of softmax(Q_i(s_t, .)) at a_t
    awac: torch.Tensor  # -log pi(a_t | s_t), weighted by exp(awac_beta (targetQ - V)) (no gradient in the weight)
    advantage: torch.Tensor  # min_i targetQ_i(s_t, a_t) - V(s_t), detached (for statistics)


def next_values(values: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``V(s_t+1)`` for every token: the next token's value when it belongs to the same candidate, else 0 (the
    state after a continuation's last token is terminal)."""
    following = torch.zeros_like(values)
    if values.numel() > 1:
        same = candidate[1:] == candidate[:-1]
        following[:-1] = torch.where(same, values[1:], torch.zeros_like(values[1:]))
    return following


def ilql_losses(q_heads: list[torch.Tensor], target_q_heads: list[torch.Tensor], values: torch.Tensor,
                actions: torch.Tensor, action_logprobs: torch.Tensor, rewards: torch.Tensor, candidate: torch.Tensor,
                gamma: float, tau: float, awac_beta: float = 0.0) -> ILQLTerms:
    """The per-token ILQL terms (trlX's ``ILQLConfig.loss`` before its mean over tokens).

    Args:
        q_heads / target_q_heads: per Q head, ``[n_tokens, vocab]`` Q(s_t, .) (the targets without gradients).
        values: ``[n_tokens]`` V(s_t).
        actions: ``[n_tokens]`` the token ids taken.
        action_logprobs: ``[n_tokens]`` the language model's log-prob of each action.
        rewards: ``[n_tokens]`` the reward of each action (a continuation's reward on its last token).
        candidate: ``[n_tokens]`` the candidate of each token (consecutive tokens of one candidate are its states).
        gamma: the discount; tau: the expectile (0.5 is a mean; above it V leans to the best actions' Q).
        awac_beta: the advantage-weighting temperature of the language-model term (0: plain likelihood).
    """
    index = actions[:, None]
    q_taken = [q.gather(-1, index).squeeze(-1) for q in q_heads]
    target = torch.stack([q.gather(-1, index).squeeze(-1) for q in target_q_heads]).min(0).values.detach()
    q_goal = rewards + gamma * next_values(values, candidate).detach()
    q_term = sum((q - q_goal) ** 2 for q in q_taken)
    gap = target - values
    v_term = torch.where(gap >= 0, tau, 1 - tau) * gap ** 2
    cql = sum(torch.nn.functional.cross_entropy(q.float(), actions, reduction="none") for q in q_heads)
    weight = torch.exp(awac_beta * gap.detach())
    return ILQLTerms(q_term, v_term, cql, -action_logprobs * weight, gap.detach())


def steered_logits(logits: torch.Tensor, target_q_heads: list[torch.Tensor], values: torch.Tensor, beta: float
                   ) -> torch.Tensor:
    """What ILQL samples from: ``log_softmax(logits) + beta * (min_i targetQ_i(s, .) - V(s))`` (``[rows, vocab]``;
    ``values``: ``[rows]``)."""
    advantage = torch.stack(target_q_heads).min(0).values - values[:, None]
    return torch.log_softmax(logits.float(), -1) + beta * advantage.float()


@torch.no_grad()
def polyak_update(targets: list[torch.nn.Module], sources: list[torch.nn.Module], alpha: float,
                  masters: dict | None = None) -> None:
    """``target <- alpha * source + (1 - alpha) * target``, parameter by parameter (trlX's target Q sync).

    A target below float32 (a bfloat16 or float16 model's heads, which have no optimizer's float32 copy) cannot take
    a small step: with ``alpha`` 0.001, bfloat16's 0.5 moved towards 0.6 rounds back to 0.5, so the targets would
    stop following. ``masters`` (a dict the caller keeps from sync to sync) then holds a float32 copy of each such
    target, updated there and copied in; it is made again from the target whenever the two differ (a resume, a
    load). Without ``masters`` every target is updated in its own dtype."""
    for target, source in zip(targets, sources):
        for t, s in zip(target.parameters(), source.parameters()):
            if masters is None or t.dtype in (torch.float32, torch.float64):
                t.mul_(1 - alpha).add_(s.detach(), alpha=alpha)
                continue
            master = masters.get(id(t))
            if master is None or master.shape != t.shape or not torch.equal(master.to(t.dtype), t.detach()):
                master = masters[id(t)] = t.detach().float().clone()
            master.mul_(1 - alpha).add_(s.detach().float(), alpha=alpha)
            t.copy_(master)
