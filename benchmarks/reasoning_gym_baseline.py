"""Greedy accuracy of a model on a few easy reasoning-gym tasks, with plain Hugging Face ``generate`` in one process
(no run, no servers): which task leaves a small model something to learn.

    .venv/bin/python -m benchmarks.reasoning_gym_baseline [--model builtin:smollm2-135m-instruct] [--items 30]
        [--tasks leg_counting,count_bits] [--answer-format tag|last_line|last_number|full]

Each task is a :class:`llmrl.engine.envs.ReasoningGymTask` (chat prompts, the default system prompt asking for
``<answer>...</answer>``, or for the last line with ``--answer-format last_line`` or ``last_number``); the
completions are decoded greedily, left-padded in batches. Per task it prints the mean reward with the task's own
extraction and the dataset's ``score_answer``, the pass rate (reward 1), and a lenient score that reads the first
number or word after ``<answer>``, else the completion's last one (does the model know the answer but miss the
format?). It writes nothing.
"""

from __future__ import annotations

import argparse
import re
import time

CANDIDATES = {  # easy settings of easy datasets
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+", "-"),
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "count_bits": {"min_n": 1, "max_n": 15},
    "letter_counting": {"min_words": 1, "max_words": 3},
}
FIRST_TOKEN = re.compile(r"-?\d+(?:\.\d+)?|[A-Za-z]+")


def load(model_name: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmrl.engine.model.store.builtin_models import BUILTIN_PREFIX, builtin_model_path

    path = builtin_model_path(model_name[len(BUILTIN_PREFIX):]) if model_name.startswith(BUILTIN_PREFIX) else model_name
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model


def complete(tokenizer, model, prompts: list, max_new_tokens: int, batch: int) -> list[str]:
    import torch

    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    out = []
    for start in range(0, len(texts), batch):
        enc = tokenizer(texts[start:start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def lenient(completion: str) -> str | None:
    """The first number or word after an opening answer tag if there is one, else the completion's last one (an
    explanation tends to end with its result)."""
    if "<answer>" in completion:
        match = FIRST_TOKEN.search(completion.split("<answer>", 1)[1])
        return match.group(0) if match else None
    found = FIRST_TOKEN.findall(completion)
    return found[-1] if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=30)
    parser.add_argument("--tasks", default=",".join(CANDIDATES))
    parser.add_argument("--answer-format", default="tag", choices=("tag", "last_line", "last_number", "full"),
                        help="the answer convention the prompts ask for and the reward reads")
    args = parser.parse_args()

    import torch

    from llmrl.engine.envs import ReasoningGymTask

    torch.manual_seed(0)
    tokenizer, model = load(args.model)
    print(f"{'task':18} {'reward':>7} {'pass':>6} {'lenient':>8} {'seconds':>8}  first completion")
    for name in args.tasks.split(","):
        task = ReasoningGymTask(name, size=args.items, seed=args.seed, dataset_args=CANDIDATES[name],
                                answer_format=args.answer_format)
        start = time.perf_counter()
        completions = complete(tokenizer, model, task.prompts(), args.max_new_tokens, args.batch)
        rewards = [task.reward(i, c) for i, c in enumerate(completions)]
        loose = [task.dataset.score_answer(lenient(c), e) for c, e in zip(completions, task.entries)]
        n = len(rewards)
        print(f"{name:18} {sum(rewards) / n:7.3f} {sum(r >= 1 for r in rewards) / n:6.3f} {sum(loose) / n:8.3f} "
              f"{time.perf_counter() - start:8.1f}  {completions[0]!r:.70}", flush=True)


if __name__ == "__main__":
    main()
