"""Helpers of the tests that drive ``llmrl tinker`` through the ``tinker`` SDK: datums (as the Caller takes them, and
as the SDK sends them), the served model's name as the SDK reads it, and the adapter a save exported.

Test code, never shipped.
"""

from __future__ import annotations

import os

import torch


def served_model(client) -> str:
    """The served model's name, as the SDK reads it (what a Tinker user passes as ``base_model``)."""
    return client.get_server_capabilities().supported_models[0].model_name


def datums(seed: int, count: int = 3) -> list[dict]:
    """``count`` datums (token sequences 7, 11 and 5 long) with advantages and behaviour log-probs, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (7, 11, 5)[:count]:
        tokens = torch.randint(3, 100, (n,), generator=g).tolist()
        out.append({"model_input": tokens[:-1], "loss_fn_inputs": {
            "target_tokens": tokens[1:], "advantages": torch.randn(n - 1, generator=g).tolist(),
            "logprobs": (-torch.rand(n - 1, generator=g) * 3 - 2).tolist()}})
    return out


def sdk_datum(datum: dict):
    import tinker

    inputs = {k: torch.tensor(v) for k, v in datum["loss_fn_inputs"].items()}
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(datum["model_input"]), loss_fn_inputs=inputs)


def exported_adapter(folder, pattern: str) -> dict:
    """The adapter weights of the newest PEFT file matching ``pattern`` under ``folder``."""
    from safetensors.torch import load_file

    files = sorted(folder.rglob(pattern), key=os.path.getmtime)
    return load_file(files[-1])
