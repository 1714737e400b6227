"""What an updater may reach of the served model besides forward passes: its head modules (:attr:`heads`) and
snapshots (:meth:`snapshot`, :meth:`has_snapshot`), the parts of the :class:`~llmrl.plugins.trainer_api.Trainer`
contract that touch state no optimizer step touches (``ilql``'s target Q heads, ``nlpo``'s masking policy).

It runs no forward pass and holds no training logic (:mod:`llmrl.engine.model.training.trainer` does).
"""

from __future__ import annotations

import torch


class ModelAccess:
    """Mixed into the engine's trainer, which sets ``self.served``."""

    @property
    def heads(self) -> dict[str, torch.nn.Module]:
        served = self.served
        if served.llm.training.zero_stage == 3:
            raise ValueError(f"LLM {served.llm.name!r} uses ZeRO-3, which partitions the heads' parameters: an "
                             "updater cannot change them outside an optimizer step; use ZeRO 0-2")
        return dict(served.module.heads)

    def snapshot(self, name: str, source: str | None = None) -> None:
        from llmrl.engine.model.snapshots import take_snapshot

        take_snapshot(self.served, name, source)

    def has_snapshot(self, name: str) -> bool:
        return self.served.run_time.is_snapshot(name)
