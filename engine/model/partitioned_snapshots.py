"""Weight snapshots of a model trained without LoRA under ZeRO-3: each rank keeps a copy of its own partitions.

A weight snapshot (:mod:`llmrl.engine.model.snapshots`) freezes every trained weight. Where ZeRO-3 partitions the
weights, a rank's copy of a weight is its partition (``ds_tensor``, which DeepSpeed's optimizer step writes and
every gather reads), so the snapshot costs each rank its share of the trained weights, as the weights themselves do.

A read under the snapshot (:func:`swapped_in`) points each weight's partition at the frozen copy; DeepSpeed's
gathers inside read from there. Before and after a read, every partitioned weight is released (its gathered tensor
freed, its partition kept; DeepSpeed gathers it again when a module needs it, the small ones it keeps whole
included), so nothing gathered from the trained partitions is read under the snapshot, and nothing
gathered from the snapshot is left behind for the trained model. Weights that are not partitioned are swapped
whole, as :meth:`ServedModel.adapter` swaps them under ZeRO 0-2. A checkpoint's weight snapshots are checked
against what this rank holds when it loads (:func:`check_held`).

This module does not decide when to snapshot (the script does) nor check names and caps
(:mod:`llmrl.engine.model.snapshots` does).
"""

from __future__ import annotations

import contextlib

import torch


def held(param) -> torch.Tensor:
    """What this rank holds of ``param``: its ZeRO-3 partition, or the whole weight (not partitioned)."""
    return param.ds_tensor.data if hasattr(param, "ds_id") else param.data


def held_bytes(param) -> int:
    tensor = held(param)
    return tensor.numel() * tensor.element_size()


def copy_held(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """A frozen copy of what this rank holds of each of ``params``; refuses the ZeRO-3 layouts whose partitions are
    not all in ``ds_tensor`` on the device (ZeRO++'s secondary partitions, parameters offloaded to CPU or NVMe)."""
    for name, p in params.items():
        if hasattr(p, "ds_id") and (getattr(p, "ds_secondary_tensor", None) is not None
                                    or getattr(p.ds_tensor, "final_location", None) is not None
                                    or p.ds_tensor.device != p.device):
            raise ValueError(f"a weight snapshot under ZeRO-3 copies each rank's partition of every trained weight; "
                             f"{name}'s is kept elsewhere too (ZeRO++ secondary partitions, or offload_param in "
                             "training.deepspeed): drop those settings, or train with LoRA")
    return {name: held(p).detach().clone() for name, p in params.items()}


def check_held(params: dict[str, torch.nn.Parameter], snapshot: str, frozen: dict[str, torch.Tensor]) -> None:
    """Refuse a snapshot (read from a checkpoint) whose copies are not what this rank holds of the weights: taken
    under another partitioning (another replica count or ZeRO stage), it would be read torn. Checked when the
    checkpoint loads, where a refusal ends the start-up, not in a read, where the other ranks would wait in a
    gather for this one."""
    for name, tensor in frozen.items():
        if name not in params or held(params[name]).shape != tensor.shape:
            now = tuple(held(params[name]).shape) if name in params else "nothing"
            raise ValueError(f"weight snapshot {snapshot!r} holds {name} as {tuple(tensor.shape)}, and this rank "
                             f"holds {now} of it: the checkpoint was saved with another replica count or ZeRO stage; "
                             "resume with the saved layout")


@contextlib.contextmanager
def swapped_in(params: dict[str, torch.nn.Parameter], frozen: dict[str, torch.Tensor], release):
    """Inside, each of ``params`` reads as its copy in ``frozen``; after, even on an error, as before. ``release()``
    frees every gathered weight (DeepSpeed's own release, which waits for gathers in flight)."""
    release()
    trained = {name: held(p) for name, p in params.items()}
    try:
        for name, p in params.items():
            _point(p, frozen[name])
        yield
    finally:
        try:
            release()
        finally:  # the trained weights come back even when the release fails
            for name, p in params.items():
                _point(p, trained[name])


def _point(param, tensor: torch.Tensor) -> None:
    if hasattr(param, "ds_id"):
        param.ds_tensor.data = tensor
    else:
        param.data = tensor
