"""The OpenAI endpoint inside a live run's client, for tests that reach it over HTTP from the test process: called
through :meth:`testkit.live.LiveRun.function` (``run.function("testkit.openai_live:start")``), each helper takes the
run's Caller first. Rollouts come back as plain data (a Trajectory holds its tokenizer)."""

from __future__ import annotations

RUNNING: dict = {}  # the endpoint of this client process


def start(caller, **kwargs) -> dict:
    from llmrl import openai_endpoint

    RUNNING["endpoint"] = endpoint = openai_endpoint(caller, **kwargs)
    return {"base_url": endpoint.base_url, "api_key": endpoint.api_key}


def pop(caller, rollout_id: str) -> dict:
    rollout = RUNNING["endpoint"].pop(rollout_id)
    return {"reasons": rollout.reasons, "calls": rollout.calls, "trajectories": [
        {"ids": t.ids, "model_mask": t.model_mask, "sampling_logprobs": t.sampling_logprobs,
         "model_logprobs": t.model_logprobs, "turns": [(turn.start, turn.end) for turn in t.turns]}
        for t in rollout.trajectories]}


def stop(caller) -> None:
    RUNNING.pop("endpoint").close()


def play_verifiers(caller, prompt: str, system_prompt: str, k: int, sampling: dict) -> list[dict]:
    """``k`` rollouts of :class:`testkit.verifiers_tasks.Sum` (a single-turn question) played on the run's model
    through the running endpoint by :func:`llmrl.engine.envs.verifiers_env.run_verifiers`."""
    from llmrl.engine.envs.verifiers_env import Play, run_verifiers
    from testkit import verifiers_tasks as tasks

    task = tasks.Sum(tasks.vf.TaskData(prompt=prompt, system_prompt=system_prompt))
    result = run_verifiers(RUNNING["endpoint"], [task], Play(k=k, concurrency=1, sampling=sampling))
    return [{"reward": r.reward, "rewards": r.rewards, "error": r.error and str(r.error),
             "reply": [m["content"] for m in r.messages if m["role"] == "assistant"][-1],
             "trajectories": [{"ids": t.ids, "sampling_logprobs": t.sampling_logprobs} for t in r.trajectories]}
            for r in result.rollouts[0]]
