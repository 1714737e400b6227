"""Load an LLM's tokenizer and Hugging Face model as its config says.

Handles: local folders, hub ids and ``builtin:`` models; ``from_pretrained: false`` (same
architecture, random weights); dtype; 4/8-bit quantisation with bitsandbytes; ZeRO-3 (weights are
partitioned while they load, through transformers' ``HfDeepSpeedConfig``); the config's ``model_kwargs``
(passed to ``from_pretrained``, or split between the model config and ``from_config``, as ``from_pretrained``
does) and ``pad_token_id`` (checked against the tokenizer and the model's vocabulary). The model is returned on
its device and in evaluation mode (dropout off: scores and updates see the same function).

It does not build the DeepSpeed engine or attach heads; :mod:`llmrl.engine.model.hf_backend` does.
"""

from __future__ import annotations

import os

import torch

from llmrl.engine.config import BUILTIN_MODEL_PREFIX, LLMConfig
from llmrl.engine.config.checks import POSITION_KEYS


def resolve_model_path(location: str) -> str:
    if location.startswith(BUILTIN_MODEL_PREFIX):
        from llmrl.engine.model.store.builtin_models import builtin_model_path

        return str(builtin_model_path(location[len(BUILTIN_MODEL_PREFIX):]))
    expanded = os.path.expanduser(location)
    return expanded if os.path.exists(expanded) else location


def load_tokenizer(llm: LLMConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(llm.tokenizer or llm.model)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=llm.trust_remote_code, revision=llm.revision)
    if llm.pad_token_id is not None:
        set_pad_token(tokenizer, llm)
    elif tokenizer.pad_token_id is None:
        # Padding positions are always masked out, so any id works; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def set_pad_token(tokenizer, llm: LLMConfig, vocab_size: int | None = None) -> None:
    """Make ``llms.<name>.pad_token_id`` the tokenizer's pad token; raise ValueError naming the key when the id is
    not a token of the tokenizer or (given ``vocab_size``, the model's input embedding rows) of the model."""
    pad = llm.pad_token_id
    at = f"llms.{llm.name}.pad_token_id"
    if not 0 <= pad < len(tokenizer):
        raise ValueError(f"{at} is {pad} but the tokenizer has {len(tokenizer)} tokens (ids 0..{len(tokenizer) - 1}); "
                         "choose one of its ids, such as its EOS or UNK token's")
    if vocab_size is not None and pad >= vocab_size:
        raise ValueError(f"{at} is {pad} but the model's vocabulary has {vocab_size} entries (ids 0..{vocab_size - 1})")
    tokenizer.pad_token_id = pad
    if tokenizer.pad_token_id != pad:
        raise ValueError(f"{at}: the tokenizer refused {pad} as its pad token")


def model_class(llm: LLMConfig):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if llm.type == "seq2seq" else AutoModelForCausalLM


def load_model(llm: LLMConfig, device: torch.device, deepspeed_config: dict | None = None):
    """The model on ``device`` in eval mode. Pass the DeepSpeed config when it uses ZeRO-3.

    Returns ``(model, keepalive)``: keep ``keepalive`` referenced while the engine lives (ZeRO-3 needs
    the ``HfDeepSpeedConfig`` object alive).
    """
    path = resolve_model_path(llm.model)
    dtype = getattr(torch, llm.dtype)
    cls = model_class(llm)
    keepalive = None
    if deepspeed_config and deepspeed_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # (without its tensor_parallel section: transformers refuses to load a checkpoint whose weight names it
        # maps under DeepSpeed's tensor parallelism; the weights load whole, partitioned over the ranks, and
        # DeepSpeed's AutoTP gathers each and keeps this rank's shard when the engine is built)
        keepalive = HfDeepSpeedConfig({k: v for k, v in deepspeed_config.items() if k != "tensor_parallel"})
    common = {"trust_remote_code": llm.trust_remote_code, "revision": llm.revision}
    try:
        model = _construct(cls, path, llm, dtype, device, common)
    except TypeError as err:
        if not llm.model_kwargs or "unexpected keyword" not in str(err):
            raise
        raise TypeError(f"{err} (llms.{llm.name}.model_kwargs passes {sorted(llm.model_kwargs)} to the model's "
                        "from_pretrained; remove the keys it does not accept)") from err
    if keepalive is None and llm.quantization is None:
        model.to(device)
    model.eval()
    return model, keepalive


def _construct(cls, path: str, llm: LLMConfig, dtype, device: torch.device, common: dict):
    """``from_pretrained`` (or ``from_config``) with the config's dtype, quantisation and ``model_kwargs``."""
    extra = dict(llm.model_kwargs)
    if not llm.from_pretrained:
        from transformers import AutoConfig

        # As from_pretrained does: keys the model config knows update it, the others go to the constructor.
        config, unused = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **common, **extra)
        return cls.from_config(config, dtype=dtype, trust_remote_code=llm.trust_remote_code, **unused)
    if llm.quantization is not None:
        from transformers import BitsAndBytesConfig

        q = llm.quantization
        quant = BitsAndBytesConfig(
            load_in_4bit=q.bits == 4, load_in_8bit=q.bits == 8, bnb_4bit_quant_type=q.quant_type,
            bnb_4bit_compute_dtype=getattr(torch, q.compute_dtype), bnb_4bit_use_double_quant=q.double_quant,
        )
        model = cls.from_pretrained(path, dtype=dtype, quantization_config=quant, device_map={"": str(device)},
                                    **common, **extra)
        if device.type == "cpu":
            keep_4bit_exact_on_cpu(model)
        return model
    return cls.from_pretrained(path, dtype=dtype, **common, **extra)


def max_input_length(model, tokenizer, llm: LLMConfig) -> int | None:
    """The longest input the model accepts: the config's ``max_length``, else the model's own limit."""
    if llm.max_length is not None:
        return llm.max_length
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in POSITION_KEYS:  # the same keys the config check reads
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**8 else None


def keep_4bit_exact_on_cpu(model) -> None:
    """Keep bitsandbytes' 4-bit layers on their exact, differentiable CPU path.

    On CPUs with AVX512-BF16, a ``Linear4bit`` repacks its weight for a fused bf16 kernel the first time it runs in
    evaluation mode without gradients (every ``score`` call does): from then on that layer computes in bf16 whatever
    ``compute_dtype`` says, passes no gradient to its input (the kernel has no autograd formula, so LoRA adapters
    below it silently stop learning), and its ``state_dict`` keeps the repacked statistics. The
    dequantise-then-matmul path is exact and differentiable; it is what other CPUs use anyway.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
