"""The verifiers tasks of ``test_verifiers_env``: a single-turn question whose two rewards are weighted, and a
guess-a-number game with a metric. Imports ``verifiers`` (seconds of imports): the test module takes it in a fixture,
so that collecting the suite does not pay for it.

Test code, never shipped.
"""

from __future__ import annotations

import verifiers.v1 as vf


class Sum(vf.Task[vf.TaskData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == "4")

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) <= 2)


class Guess(vf.Task[vf.TaskData]):
    @vf.reward
    async def found(self, trace) -> float:
        return float(trace.last_reply == "7")

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(len(trace.assistant_messages))


class Tool(vf.Task[vf.TaskData]):
    @vf.reward
    async def right(self, trace) -> float:
        return float(trace.last_reply == "5" and trace.tool_messages[0].content == "5")
