"""Score candidate actions and generate text with the default offline model (SmolLM2-135M-Instruct).

    llmrl run --config configs/cpu-single.yaml examples/score_and_generate.py

Prints, for a few text-game observations, the policy over the offered actions (softmax of the
candidates' log-probabilities) and a short generated continuation with its token log-probs.
"""

from __future__ import annotations

import argparse

from llmrl import Caller

OBSERVATIONS = [
    ("Your goal: go to the red ball. The red ball is 2 steps in front of you.",
     ["go forward", "turn left", "turn right"]),
    ("Your goal: go to the red ball. The red ball is on your left.", ["go forward", "turn left", "turn right"]),
    ("You are in the kitchen. Your goal: go north.", ["go north", "go south", "open fridge"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=12, help="tokens generated per prompt")
    args = parser.parse_args()
    with Caller() as caller:
        prompts = [f"{observation}\nAction:" for observation, _ in OBSERVATIONS]
        actions = [[" " + a for a in acts] for _, acts in OBSERVATIONS]
        policies = caller.score(prompts, actions, normalize=True, probabilities=True)
        for (observation, acts), policy in zip(OBSERVATIONS, policies):
            print(observation)
            for action, p in sorted(zip(acts, policy.tolist()), key=lambda x: -x[1]):
                print(f"    {p:6.1%}  {action}")
        for prompt, (sample,) in zip(prompts, caller.generate(prompts, max_new_tokens=args.max_new_tokens,
                                                              do_sample=False)):
            print(f"{prompt!r} -> {sample['text']!r} (log-prob {sample['logprob']:.2f} over "
                  f"{len(sample['tokens'])} tokens)")


if __name__ == "__main__":
    main()
