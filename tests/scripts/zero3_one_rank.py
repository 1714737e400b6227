"""Run by tests/test_zero3_one_rank.py in its own process (it starts a torch.distributed world of one rank): a tiny
Llama with a LoRA adapter (non-zero, so it counts) in a DeepSpeed ZeRO-3 engine of one rank, checked against a copy
of the same model kept outside DeepSpeed. Prints one JSON line of findings; the test asserts on them."""

import copy
import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from llmrl.engine.model import zero3_gather  # noqa: E402


def logits(module, ids):
    with torch.no_grad():
        return module(input_ids=ids).logits


def gathered_logits(engine, ids):
    with zero3_gather.gathered_weights(engine, 4096) as whole:
        assert whole
        return logits(engine.module, ids)


def partitioned(module) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return all(p.numel() == 0 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in module.parameters())


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    lora = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(model, lora).eval()
    reference = copy.deepcopy(model)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the servers do: no op compiled (~25 s)
    deepspeed.init_distributed(dist_backend="gloo")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
    engine.eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 8]])
    out = {"partitioned_at_start": partitioned(engine.module)}
    plan = zero3_gather._call_plan(engine.module, [*engine.optimizer.parameter_offload.forward_hooks,
                                                   *engine.optimizer.parameter_offload.backward_hooks])
    out["own_shards"] = plan.own_shards
    want = logits(reference, ids)
    ours = before = gathered_logits(engine, ids)
    out["gathered_vs_reference"] = float((ours - want).abs().max())
    out["partitioned_after_call"] = partitioned(engine.module)
    out["hooked_vs_reference"] = float((logits(engine.module, ids) - want).abs().max())

    plan.own_shards = False  # the same call through DeepSpeed's own gather
    out["deepspeed_gather_vs_ours"] = float((gathered_logits(engine, ids) - ours).abs().max())
    plan.own_shards = True

    engine.train()  # one training step through DeepSpeed's hooks: the shards change in place
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    out["available_after_step"] = sum(p.numel() > 0 for p in engine.module.parameters())  # DeepSpeed's persisted
    ours = gathered_logits(engine, ids)  # right after the step, as a call after an update
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    reference.load_state_dict(trained)
    want = logits(reference, ids)
    out["training_moved_logits"] = float((ours - before).abs().max())
    out["trained_gathered_vs_reference"] = float((ours - want).abs().max())
    out["trained_hooked_vs_reference"] = float((logits(engine.module, ids) - want).abs().max())

    class CallFailed(Exception):
        pass

    try:  # a call that fails inside leaves every weight partitioned and the hooks in place
        with zero3_gather.gathered_weights(engine, 4096):
            raise CallFailed
    except CallFailed:
        pass
    out["partitioned_after_error"] = partitioned(engine.module)
    out["hooked_after_error_vs_reference"] = float((logits(engine.module, ids) - want).abs().max())
    out["gathered_calls"] = engine.llmrl_gathered_calls
    print(json.dumps(out))


if __name__ == "__main__":
    main()
