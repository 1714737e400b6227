"""PPO with LoRA in BabyAI-Text with hand-written plugins: Lamorel's PPO-with-LoRA structure, in llmrl.

    llmrl run --config configs/ppo-babyai-custom.yaml examples/ppo_lora_custom.py   # the three classes below
    llmrl run --config configs/ppo-babyai.yaml examples/ppo_lora_custom.py          # the built-in plugins

The three classes are what Lamorel's example writes as a module function (the value head), a model initializer
(LoRA) and an updater (PPO). configs/ppo-babyai-custom.yaml names them ``__main__:ValueHead`` and so on: server
ranks import this file as a module to find them (its top level only; the RL loop under
``if __name__ == "__main__":`` runs on rank 0 alone). With configs/ppo-babyai.yaml the built-in ``value``, ``lora``
and ``ppo`` plugins serve instead, and the loop is unchanged. docs/porting/lamorel.md walks through it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from llmrl import Caller
from llmrl.plugins import ForwardOutputs, Head, Initializer, LLMInfo, Trainer, UpdateBatch, Updater
from llmrl.plugins.rl_math import gae


class ValueHead(Head):
    """V(context): an MLP on the last layer's hidden state at the context's last token."""

    level = "context"  # one output per context ("candidate": one per candidate)
    needs_context_hidden = True  # the engine takes it at the right token: no position arithmetic here

    def __init__(self, llm: LLMInfo, hidden: int = 128):
        super().__init__(llm)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(llm.hidden_size, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, outputs: ForwardOutputs) -> torch.Tensor:
        return self.mlp(outputs.context_hidden.float()).squeeze(-1)


class LoraInitializer(Initializer):
    """LoRA adapters on every linear layer (or on ``target_modules``); the base weights are frozen."""

    def __init__(self, r: int = 8, alpha: float = 16.0, target_modules: list[str] | None = None):
        self.r, self.alpha, self.target_modules = r, alpha, target_modules or "all-linear"

    def initialize(self, model, llm: LLMInfo):
        from peft import LoraConfig, TaskType, get_peft_model

        task = TaskType.SEQ_2_SEQ_LM if llm.kind == "seq2seq" else TaskType.CAUSAL_LM
        config = LoraConfig(task_type=task, r=self.r, lora_alpha=self.alpha, lora_dropout=0.0,
                            target_modules=self.target_modules)
        return get_peft_model(model, config)  # served from now on; only the adapters' weights train


def ppo_loss(out: ForwardOutputs, mb: UpdateBatch, clip_eps: float, value_coef: float, entropy_coef: float):
    """Per-sample PPO loss of a minibatch whose policy is the softmax over each context's candidates."""
    scores, mask = out.scores_by_context()  # [n, K]: log p(candidate | context), -inf where a context has fewer
    logp_all = torch.log_softmax(scores.float(), dim=-1)

    def column(key: str, dtype=torch.float32) -> torch.Tensor:
        return torch.as_tensor(mb.kwargs[key], dtype=dtype, device=scores.device)

    logp = logp_all.gather(1, column("actions", torch.long)[:, None]).squeeze(1)
    ratio = torch.exp(logp - column("old_logprobs"))
    advantages = column("advantages")
    policy_loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    value_loss = 0.5 * (out.heads["value"].float() - column("returns")) ** 2
    entropy = -(logp_all.exp() * logp_all.masked_fill(~mask, 0.0)).sum(-1)
    loss = policy_loss + value_coef * value_loss - entropy_coef * entropy
    return loss, {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy}


class PPOUpdater(Updater):
    """Clipped PPO with a value loss and an entropy bonus. The optimizer, gradient accumulation, clipping and
    the averaging across replicas are the trainer's (``llms.<name>.training``)."""

    def __init__(self, epochs: int = 1, clip_eps: float = 0.2, value_coef: float = 0.5, entropy_coef: float = 0.01,
                 seed: int = 0):
        self.epochs, self.clip_eps, self.value_coef, self.entropy_coef = epochs, clip_eps, value_coef, entropy_coef
        self.generator = torch.Generator().manual_seed(seed)

    def update(self, batch: UpdateBatch, trainer: Trainer) -> dict[str, float]:
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.epochs):
            for mb in batch.minibatches(trainer.micro_batch_size, shuffle=True, generator=self.generator):
                out = trainer.forward(mb.contexts, mb.candidates, heads=["value"])  # scores and values, with grads
                loss, terms = ppo_loss(out, mb, self.clip_eps, self.value_coef, self.entropy_coef)
                trainer.backward(mb.mean(loss))  # the exact mean over the step's samples on every replica
                trainer.step()
                for key, value in terms.items():
                    sums[key] = sums.get(key, 0.0) + float(value.detach().sum())
                count += len(mb)
        return {**{key: value / max(count, 1) for key, value in sums.items()}, "samples": len(batch)}


def prompt(obs) -> str:
    return f"Goal: {obs.goal}.\n{obs.description}\nPossible actions: {', '.join(obs.actions)}.\nAction:"


def main() -> None:
    parser = argparse.ArgumentParser(description="PPO with LoRA in BabyAI-Text")
    parser.add_argument("--updates", type=int, default=12, help="PPO updates")
    parser.add_argument("--envs", type=int, default=16, help="environments stepped together")
    parser.add_argument("--steps", type=int, default=16, help="steps of every environment per update")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from babyai_text import TextVecEnv  # examples/babyai_text.py (imported here: the servers do not need it)

    env = TextVecEnv("BabyAI-GoToRedBallNoDists-v0", args.envs, seeds=list(range(args.envs)), max_steps=24,
                     seed_stride=args.envs)
    obs = env.reset()
    generator = torch.Generator().manual_seed(0)
    with Caller() as caller:
        for update in range(args.updates):
            rows: dict[str, list] = {key: [] for key in ("contexts", "candidates", "actions", "logprobs", "values",
                                                         "rewards", "dones")}
            episodes = []
            for _ in range(args.steps):
                contexts = [prompt(o) for o in obs]
                candidates = [[" " + action for action in o.actions] for o in obs]
                out = caller.score(contexts, candidates, additional_module_function_keys=["value"])  # one pass
                policies = [torch.log_softmax(entry["score"], 0) for entry in out]  # over the offered actions
                actions = [int(torch.multinomial(p.exp(), 1, generator=generator)) for p in policies]
                obs, rewards, dones, infos = env.step([o.actions[a] for o, a in zip(obs, actions)])
                step = {"contexts": contexts, "candidates": candidates, "actions": actions,
                        "logprobs": [float(p[a]) for p, a in zip(policies, actions)],
                        "values": [float(entry["value"]) for entry in out], "rewards": rewards, "dones": dones}
                for key, value in step.items():
                    rows[key].append(value)
                episodes += [info["episode"] for info in infos if "episode" in info]
            last_values = [float(v["value"]) for v in caller.custom_module_fns(["value"], [prompt(o) for o in obs])]
            advantages, returns = gae(torch.tensor(rows["rewards"]), torch.tensor(rows["values"]),
                                      torch.tensor(rows["dones"]), torch.tensor(last_values), gamma=0.99, lam=0.95)
            flat = {key: [x for row in rows[key] for x in row] for key in ("contexts", "candidates", "actions",
                                                                           "logprobs")}
            stats = caller.update(flat["contexts"], flat["candidates"], actions=flat["actions"],
                                  old_logprobs=flat["logprobs"], advantages=advantages.flatten().tolist(),
                                  returns=returns.flatten().tolist())  # one dict per replica
            successes = sum(e.success for e in episodes)
            caller.log({"train/success_rate": successes / max(1, len(episodes))})  # beside update's own statistics
            print(f"update {update + 1}: {successes}/{len(episodes)} episodes succeeded, policy loss "
                  f"{stats[0]['policy_loss']:.4f}, entropy {stats[0]['entropy']:.3f}", flush=True)
    env.close()


if __name__ == "__main__":
    main()
