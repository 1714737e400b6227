"""One rank of a 2-process gloo world: on rank 1, save through Hugging Face and prepare a builtin model.

Usage: hf_save_on_rank.py OUT_DIR (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LLMRL_CACHE in the env).
Rank 1 writes OUT_DIR/report.json: which files each save wrote, and where the builtin model went.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        from peft import LoraConfig, get_peft_model

        from llmrl.engine.model.store.builtin_models import prepare_builtin
        from llmrl.engine.model.store.tiny_models import build_tiny

        model, tokenizer = build_tiny("llama")
        report = {}
        plain = out / "plain_model_save"
        model.save_pretrained(plain)  # transformers' default: is this rank allowed to write?
        report["plain_model_save"] = sorted(os.listdir(plain))
        # What engine/checkpoint.py's export calls on a group leader.
        export = out / "export"
        tokenizer.save_pretrained(export / "tokenizer")
        model.config.save_pretrained(export / "model")
        model.generation_config.save_pretrained(export / "model")
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        peft_model.peft_config["default"].save_pretrained(export / "adapter")
        report["export"] = {sub: sorted(os.listdir(export / sub)) for sub in ("tokenizer", "model", "adapter")}
        report["builtin"] = str(prepare_builtin("tiny-random-llama"))
        report["torch_distributed_initialized"] = dist.is_initialized()
        (out / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
