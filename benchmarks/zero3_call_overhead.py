"""The fixed cost of one gathered ZeRO-3 call: what it takes to make every weight whole and take DeepSpeed's hooks
off, and to undo both after, with no forward in between. In this process, a DeepSpeed ZeRO-3 engine of one rank
(gloo, on the CPU), in one run:

- ``deepspeed-unwrap``: the way DeepSpeed's users take a ZeRO-3 model out for generation (TRL's
  ``unwrap_model_for_generation``): ``deepspeed.zero.GatheredParameters`` over every weight, the hooks removed
  handle by handle, and registered anew after;
- ``llmrl``: ``engine/model/zero3_gather.gathered_weights``, as ``score``, ``generate`` and an update's
  gradient-free passes run it.

    .venv/bin/python -m benchmarks.zero3_call_overhead                # both adapter layouts below
    .venv/bin/python -m benchmarks.zero3_call_overhead --layouts all-layers --calls 50

The weights' sizes do not matter to this cost (in a group of one rank nothing is copied), their number and the
modules' do, so the models are narrow with real layer layouts: ``top-8`` is SmolLM2-135M's 30 layers with LoRA on
every linear layer of the top 8 (``benchmarks.zero3_serving``'s adapter); ``all-layers`` is SmolLM2-1.7B's 24
layers with LoRA r=16 on every linear layer (the GPU GRPO benchmark's, issue 33). It prints milliseconds a call
(median of ``--repeats`` runs of ``--calls`` calls, garbage collection on, as in a server) and the ratio.
It writes nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

LAYOUTS = {"top-8": {"layers": 30, "lora_layers": 8, "r": 8}, "all-layers": {"layers": 24, "lora_layers": 24, "r": 16}}


def build_engine(layers: int, lora_layers: int, r: int):
    import deepspeed
    import peft
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.LoraConfig(r=r, target_modules=targets, layers_to_transform=list(range(layers - lora_layers, layers)))
    model = peft.get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    engine.eval()
    with torch.no_grad():  # one hooked forward first, as a server's first call makes
        engine(torch.tensor([[1, 2, 3]]))
    return engine


def deepspeed_unwrap(engine):
    """TRL's ``unwrap_model_for_generation`` for a ZeRO-3 engine, enter and exit."""
    import deepspeed

    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for param in engine.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        offload._register_deepspeed_module(offload.module)


def llmrl_gathered(engine):
    from llmrl.engine.model.zero3_gather import gathered_weights

    with gathered_weights(engine, 4096) as whole:
        assert whole


def per_call_ms(fn, engine, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(engine)
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="of " + ", ".join(LAYOUTS))
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as llmrl's servers: no op to build (~50 s)
    deepspeed.init_distributed(dist_backend="gloo")
    for layout in args.layouts.split(","):
        engine = build_engine(**LAYOUTS[layout])
        modules = sum(1 for _ in engine.module.modules())
        weights = sum(1 for _ in engine.module.parameters())
        offload = engine.optimizer.parameter_offload
        hooks = len(offload.forward_hooks) + len(offload.backward_hooks)
        times = {name: [] for name in ("deepspeed-unwrap", "llmrl")}
        for _ in range(args.repeats):  # alternated, so that both meet the same machine
            for name, fn in (("deepspeed-unwrap", deepspeed_unwrap), ("llmrl", llmrl_gathered)):
                fn(engine)  # untimed: llmrl finds its plan again after DeepSpeed's hooks were registered anew
                times[name].append(per_call_ms(fn, engine, args.calls))
        base, ours = statistics.median(times["deepspeed-unwrap"]), statistics.median(times["llmrl"])
        print(f"{layout}: {modules} modules, {weights} weights, {hooks} hooks; per call, median of {args.repeats} x "
              f"{args.calls} calls:")
        print(f"  deepspeed-unwrap {base:8.2f} ms")
        print(f"  llmrl            {ours:8.2f} ms   {ours / base:.3f}x ({base / ours:.1f} times faster)")


if __name__ == "__main__":
    main()
