"""trlX's examples/ppo_sentiments.py and ppo_dense_sentiments.py, rewritten for llmrl (docs/porting/trlx.md).

    llmrl run --config configs/trlx-sentiments.yaml examples/trlx_sentiments.py           # one reward per sample
    llmrl run --config configs/trlx-sentiments.yaml examples/trlx_sentiments.py --dense   # dense per-token rewards

In trlX, ``trlx.train(reward_fn=..., prompts=..., config=...)`` owns the loop. Here the script is the loop: each
round it samples ``--num-rollouts`` continuations with ``generate`` (trlX's ``gen_kwargs``, and a stop string),
scores them with a trlX-style reward function and calls ``update``; the config's ``ppo_tokens`` updater does on the
servers what trlX's PPO trainer does (a KL penalty to the starting model, a per-token value head, GAE, clipped PPO,
``cliprange_reward``). The reward functions keep trlX's signature; the dense one gets the generated token ids too,
so that it returns exactly one reward per generated token.

trlX's examples score sentiment with a DistilBERT IMDB classifier and take their prompts from IMDB reviews (two
downloads); here VADER (a lexicon scorer that runs offline) gives the "positive" probability, and the prompts are
review openings written below.
"""

from __future__ import annotations

import argparse
import random

from llmrl import Caller

PROMPTS = ["This movie was", "I watched this film", "The acting in this", "My wife and I saw", "The plot of this",
           "I went to see this", "This is the kind of", "The director of this", "I rented this movie", "The ending"]
EVAL_PROMPTS = ["I don't know much about Hungarian underground"]  # trlX's eval prompt
GEN_KWARGS = dict(max_new_tokens=40, top_k=0, top_p=1.0, do_sample=True)  # method.gen_kwargs
STOP_STRINGS = ["\n\n"]  # trlx.train(stop_sequences=...): generation ends with the token that completes one


def positive(texts: list[str]) -> list[float]:
    """A "positive" probability per text in [0, 1] (trlX: the classifier's POSITIVE score): VADER's compound
    sentiment, mapped from [-1, 1]."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    return [(analyzer.polarity_scores(t)["compound"] + 1) / 2 for t in texts]


def reward_fn(samples: list[str], prompts: list[str], outputs: list[str], **kwargs) -> list[float]:
    """trlX's ppo_sentiments reward: one number per sample, its positive score."""
    return positive(samples)


def dense_reward_fn(samples: list[str], prompts: list[str], outputs: list[str], tokens: list[list[int]],
                    **kwargs) -> list[list[float]]:
    """trlX's ppo_dense_sentiments reward: negative then positive. One reward per generated token: the first half's
    negative score on the middle token, the second half's positive score on the last, 0 elsewhere."""
    halves = [s.split(".") for s in samples]
    first = positive([".".join(h[: len(h) // 2]) for h in halves])
    second = positive([".".join(h[len(h) // 2:]) for h in halves])
    scores = []
    for f, s, ids in zip(first, second, tokens):
        score = [0.0] * len(ids)
        if score:
            score[len(score) // 2] = 1.0 - f
            score[-1] = s
        scores.append(score)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description="trlX's PPO sentiments example in llmrl")
    parser.add_argument("--rounds", type=int, default=20, help="rollout rounds (trlX: train.total_steps // ...)")
    parser.add_argument("--num-rollouts", type=int, default=128, help="samples per round (method.num_rollouts)")
    parser.add_argument("--max-new-tokens", type=int, default=GEN_KWARGS["max_new_tokens"], help="continuation length")
    parser.add_argument("--dense", action="store_true", help="dense per-token rewards (ppo_dense_sentiments.py)")
    args = parser.parse_args()
    gen_kwargs = {**GEN_KWARGS, "max_new_tokens": args.max_new_tokens}
    rng = random.Random(0)
    with Caller() as caller:
        for k in range(args.rounds):
            prompts = [rng.choice(PROMPTS) for _ in range(args.num_rollouts)]
            samples = [group[0] for group in caller.generate(prompts, stop_strings=STOP_STRINGS, seed=k,
                                                             **gen_kwargs)]
            outputs = [s["text"] for s in samples]
            texts = [p + o for p, o in zip(prompts, outputs)]
            tokens = [s["tokens"].tolist() for s in samples]
            if args.dense:
                rewards = dense_reward_fn(samples=texts, prompts=prompts, outputs=outputs, tokens=tokens)
            else:
                rewards = reward_fn(samples=texts, prompts=prompts, outputs=outputs)
            stats = caller.update(prompts, [[t] for t in tokens], rewards=[[r] for r in rewards],
                                  old_logprobs=[[s["logprobs"]] for s in samples])  # one dict per replica
            score = sum(positive(texts)) / len(texts)
            caller.log({"reward/positive": score})  # beside the update's own statistics (the config's tracking)
            print(f"round {k + 1}: positive {score:.3f}, kl {stats[0]['kl']:.3f}, policy loss "
                  f"{stats[0]['policy_loss']:.4f}, value loss {stats[0]['value_loss']:.4f}", flush=True)
        greedy = caller.generate(EVAL_PROMPTS, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 stop_strings=STOP_STRINGS)
        print(f"eval: {EVAL_PROMPTS[0]}{greedy[0][0]['text']!r}", flush=True)


if __name__ == "__main__":
    main()
