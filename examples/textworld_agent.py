"""A language model learns to play generated TextWorld games over many turns, trained on whole episodes.

    llmrl run --config configs/textworld.yaml examples/textworld_agent.py                 # SmolLM2-135M on CPU
    llmrl run --config configs/textworld.yaml examples/textworld_agent.py --mode write    # free text, not choices
    llmrl run --config configs/textworld-quick.yaml examples/textworld_agent.py --quick   # tiny model, CI

Games are TextWorld coin collectors of levels 2 to 5 (chains of 2 to 5 rooms; the coin is in the last one),
generated offline (:mod:`textworld_games`). Each update plays ``starts`` training games ``group`` times each with
``Caller.run_episodes``, a chat between the game and the model: in ``choose`` mode the model scores the game's
admissible commands and samples one; in ``write`` mode it writes the command. The episodes of one game are a group,
and ``grpo_turns`` (the config's updater) trains on them: every turn of an episode gets the episode's discounted
return against the group's (mean and spread), on the model's own tokens only. Before, during and after training,
the greedy policy plays held-out games (other seeds). It writes, in ``--out``: ``curve.png``, ``metrics.csv`` (one
row per update), ``summary.json`` (evaluations with 95% confidence intervals, transcripts of one held-out episode
before and after, timings), and what the config's ``tracking`` back ends record (each update's statistics on their
own, this script's scalars through ``caller.log``) in a folder named after the run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataclass_flags import flags_parser  # noqa: E402
from textworld_games import TextWorldEnv, game_path  # noqa: E402
from tqdm import tqdm  # noqa: E402

from llmrl import Caller, episode_batch  # noqa: E402
from llmrl.engine.output_folder import claim_output_folder  # noqa: E402
from llmrl.engine.provenance import run_provenance  # noqa: E402

SYSTEM = "You play a text adventure game. Reply with exactly one of the listed commands."


@dataclass
class Args:
    mode: Annotated[str, "'choose': score the admissible commands; 'write': generate the command"] = "choose"
    levels: Annotated[str, "coin collector levels (rooms in the chain)"] = "2,3,4,5"
    train_games: Annotated[int, "training games per level (seeds 0, 1, ...)"] = 24
    eval_games: Annotated[int, "held-out games per level (seeds 10000, 10001, ...)"] = 8
    starts: Annotated[int, "games per update"] = 4
    group: Annotated[int, "episodes per game per update (a GRPO group)"] = 4
    updates: Annotated[int, "GRPO updates"] = 40
    max_turns: Annotated[int, "an episode fails after this many turns"] = 8
    max_prompt_tokens: Annotated[int, (
        "an episode also fails when its prompt grows longer than this (the tiny model of --quick reads 512 at "
        "most)")] = 4096
    eval_every: Annotated[int, "held-out evaluation every this many updates (and before and after)"] = 10
    temperature: Annotated[float, "sampling temperature while training (evaluation is greedy)"] = 1.0
    choose_first: Annotated[int, "write mode: play the first this many updates in choose mode (a warm start)"] = 0
    objective: Annotated[bool, (
        "start with the game's objective, which names the way (quick: off, short prompts)")] = True
    seed: Annotated[int, "seed of the game order and the sampling"] = 0
    out: Annotated[str, "where the curve, metrics and summary go"] = "runs/textworld"
    quick: Annotated[bool, "a smoke run (CI): 2 updates of one level-1 game x 4 episodes, 2 held-out games"] = False


def parse_args() -> Args:
    parser = flags_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.mode not in ("choose", "write"):
        parser.error(f"--mode must be choose or write, got {args.mode!r}")
    if args.quick:
        # level 1 (one room: the coin is won by `take coin` among 4 commands), choices near uniform (a random model
        # gives a long command a far lower log-prob), so that the episodes of a group differ in choose mode and
        # grpo_turns takes steps
        args.levels, args.train_games, args.eval_games, args.starts, args.group = "1", 2, 2, 1, 4
        args.temperature = 100.0
        args.updates, args.max_turns, args.eval_every, args.objective = 2, 2, 1, False
        args.max_prompt_tokens = 440
    return args


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))  # holds p despite rounding (100%)


def games(args: Args, held_out: bool) -> list[tuple[int, str]]:
    """(level, path) of the training or held-out games, generated on first use."""
    cache = os.path.join(os.environ.get("LLMRL_CACHE", os.path.expanduser("~/.cache/llmrl")), "textworld")
    count, first = (args.eval_games, 10000) if held_out else (args.train_games, 0)
    return [(level, game_path(cache, level, first + k)) for level in map(int, args.levels.split(","))
            for k in range(count)]


def chat_template(caller: Caller) -> None:
    """The tiny random model of ``--quick`` has no chat template: give its client-side tokenizer ChatML written with
    its own BOS and EOS tokens (SmolLM2's template, which has one, is used as it is)."""
    tokenizer = caller.tokenizer
    if not tokenizer.chat_template:
        bos, eos = tokenizer.bos_token, tokenizer.eos_token
        tokenizer.chat_template = ("{% for m in messages %}{{ '" + bos + "' + m['role'] + '\\n' + m['content'] + '"
                                   + eos + "\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '" + bos
                                   + "assistant\\n' }}{% endif %}")
        print(f"llmrl: the model's tokenizer has no chat template; using ChatML with {bos} and {eos}", flush=True)


def play(caller: Caller, paths: list[str], args: Args, temperature: float, seed: int, mode: str | None = None):
    envs = [TextWorldEnv(path, args.objective) for path in paths]
    mode = mode or args.mode
    kwargs = {"max_new_tokens": 8, "stop": ["\n"]} if mode == "write" else None
    try:
        return caller.run_episodes(envs, mode=mode, max_turns=args.max_turns, system=SYSTEM,
                                   temperature=temperature, seed=seed, generate_kwargs=kwargs,
                                   max_prompt_tokens=args.max_prompt_tokens)
    finally:
        for env in envs:
            env.close()


def won(episode) -> bool:
    return bool(episode.infos and episode.infos[-1].get("won"))


def transcript(caller: Caller, episode) -> str:
    """The episode as the chat the model saw (its token ids decoded, special tokens dropped)."""
    tokenizer = caller.tokenizer
    return tokenizer.decode(episode.trajectory.ids, skip_special_tokens=False)


def evaluate(caller: Caller, held_out: list[tuple[int, str]], args: Args, label: str) -> dict:
    episodes = play(caller, [path for _, path in held_out], args, temperature=0.0, seed=0)
    wins = [won(e) for e in episodes]
    low, high = wilson(sum(wins), len(wins))
    per_level = {}
    for (level, _), w in zip(held_out, wins):
        per_level.setdefault(str(level), []).append(w)
    result = {"label": label, "episodes": len(wins), "success_rate": sum(wins) / len(wins), "ci95": [low, high],
              "per_level": {level: sum(w) / len(w) for level, w in per_level.items()},
              "mean_turns": sum(len(e.actions) for e in episodes) / len(episodes),
              "transcript": transcript(caller, episodes[-1]), "actions": episodes[-1].actions}
    tqdm.write(f"{label}: greedy success {result['success_rate']:.1%} (95% CI {low:.1%}-{high:.1%}) over "
               f"{len(wins)} held-out games, {result['mean_turns']:.1f} turns on average")
    return result


def train(caller: Caller, train_games, held_out, args: Args, evaluations: list) -> list[dict]:
    rng = random.Random(args.seed)
    history = []
    bar = tqdm(range(args.updates), desc=f"grpo_turns ({args.mode})", unit="update")
    for update in bar:
        start = time.time()
        chosen = rng.sample(train_games, args.starts)
        paths = [path for _, path in chosen for _ in range(args.group)]
        mode = "choose" if update < args.choose_first else args.mode
        episodes = play(caller, paths, args, args.temperature, seed=rng.randrange(2**31), mode=mode)
        groups = [episodes[k * args.group:(k + 1) * args.group] for k in range(args.starts)]
        played = time.time() - start
        stats = caller.update(**episode_batch(groups))
        samples = sum(s["samples"] for s in stats)
        row = {"update": update + 1, "mode": mode, "episodes": (update + 1) * len(episodes),
               "success_rate": sum(map(won, episodes)) / len(episodes),
               "mean_turns": sum(len(e.actions) for e in episodes) / len(episodes),
               "play_seconds": played, "update_seconds": time.time() - start - played}
        row["skipped"] = int(any(s.get("skipped") for s in stats))  # no group had a signal: no step taken
        for key in ("policy_loss", "approx_kl", "clip_fraction"):
            row[key] = sum(s.get(key, 0.0) * s["samples"] for s in stats) / max(samples, 1)
        history.append(row)
        caller.log({f"train/{key}": row[key] for key in ("success_rate", "mean_turns", "play_seconds")})
        bar.set_postfix(success=f"{row['success_rate']:.0%}", turns=f"{row['mean_turns']:.1f}")
        if (update + 1) % args.eval_every == 0 and update + 1 < args.updates:
            evaluations.append({**evaluate(caller, held_out, args, f"after {update + 1} updates"),
                                "update": update + 1})
            caller.log({"eval/success_rate": evaluations[-1]["success_rate"]})
    return history


def plot(history: list[dict], evaluations: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r["update"] for r in history], [r["success_rate"] for r in history], "o-", alpha=0.5,
            label="training episodes (sampled)")
    x = [e["update"] for e in evaluations]
    rates = [e["success_rate"] for e in evaluations]
    ax.errorbar(x, rates, yerr=[[r - e["ci95"][0] for r, e in zip(rates, evaluations)],
                                [e["ci95"][1] - r for r, e in zip(rates, evaluations)]],
                fmt="s-", capsize=5, label="held-out games, greedy (95% CI)")
    ax.set_xlabel("update")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    claim_output_folder(args.out)  # a user's own summary.json (metrics.csv, curve.png) there is never overwritten
    start = time.time()
    train_games, held_out = games(args, held_out=False), games(args, held_out=True)
    generated = time.time() - start
    with Caller(tracking={"dir": args.out}) as caller:  # the config's tracking back ends, writing under --out
        print(f"llmrl: {caller.info}", flush=True)
        chat_template(caller)
        evaluations = [{**evaluate(caller, held_out, args, "before training"), "update": 0}]
        caller.log({"eval/success_rate": evaluations[0]["success_rate"]})  # step 0: before any update
        history = train(caller, train_games, held_out, args, evaluations)
        evaluations.append({**evaluate(caller, held_out, args, "after training"), "update": args.updates})
        caller.log({"eval/success_rate": evaluations[-1]["success_rate"]})
    wall = time.time() - start
    before, after = evaluations[0], evaluations[-1]
    with open(os.path.join(args.out, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(history[0]))
        writer.writeheader()
        writer.writerows(history)
    significant = after["ci95"][0] > before["ci95"][1]
    summary = {"provenance": run_provenance(),
               "args": asdict(args), "before": before, "after": after, "evaluations": evaluations,
               "improvement_significant": significant, "wall_seconds": wall, "game_generation_seconds": generated,
               "history": history}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(history, evaluations, os.path.join(args.out, "curve.png"),
         f"grpo_turns on TextWorld coin collector ({args.mode} mode)")
    print(f"success {before['success_rate']:.1%} -> {after['success_rate']:.1%} "
          f"({'significant' if significant else 'not significant'} at 95%); {wall / 60:.1f} minutes; "
          f"results in {args.out}/ (curve.png, metrics.csv, summary.json)", flush=True)


if __name__ == "__main__":
    main()
