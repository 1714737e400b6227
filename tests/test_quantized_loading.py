"""4-bit models load on the exact CPU path: on CPUs with AVX512-BF16, bitsandbytes would repack a Linear4bit for a
bf16 kernel that has no gradient (LoRA below it would silently stop learning). Checked on any CPU by making
bitsandbytes believe it runs on such a CPU."""

from __future__ import annotations

import torch

from llmrl.engine.config import load_config
from llmrl.engine.model.store.loading import load_model


def test_no_4bit_layer_takes_the_bf16_kernel_path(tiny, monkeypatch):
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)  # as on an AVX512-BF16 CPU
    config = load_config(raw={"llms": {"q": {"model": tiny["llama"], "quantization": {"bits": 4}}}},
                         check_plugins=False)
    model, _ = load_model(config.llms["q"], torch.device("cpu"))
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    with torch.no_grad():  # a score call: eval mode, no gradient; the weights must stay in their 4-bit layout
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
