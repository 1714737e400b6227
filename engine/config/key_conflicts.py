"""Keys a config may write that llmrl would silently override or ignore, refused by name with the key to use instead.

:func:`deepspeed_problems`: entries of ``training.deepspeed`` (merged last into the DeepSpeed config by
:mod:`llmrl.engine.model.deepspeed_config`) that would override a setting llmrl derives from its own keys while
llmrl's own logic (lockstep, trunk reuse, quantization and snapshot guards, batch geometry, dtype) keeps reading
those keys. :func:`inapplicable_problems`: options that the chosen optimizer, learning-rate schedule or quantization
does not read (the sets mirror :mod:`llmrl.engine.model.training.optimizer`,
:mod:`llmrl.engine.model.training.lr_schedule` and :mod:`llmrl.engine.model.store.loading`).

Pure functions of the already schema-valid mapping of one LLM; they return ``(dotted path, message)`` problems and
never raise. This module does not build DeepSpeed configs, optimizers or models.
"""

from __future__ import annotations

from llmrl.engine.config.reference import given_or_default

Problem = tuple[str, str]

# (path inside training.deepspeed, the llmrl key it would override, relative to llms.<name>, a hint for the value)
DEEPSPEED_OWNED = (
    (("zero_optimization", "stage"), "training.zero_stage", "0, 1, 2 or 3"),
    (("train_micro_batch_size_per_gpu",), "training.micro_batch_size", "samples per backward pass on each replica"),
    (("gradient_accumulation_steps",), "training.gradient_accumulation_steps", "micro-batches per optimizer step"),
    (("gradient_clipping",), "training.gradient_clipping", "a global gradient norm; 0: no clipping"),
    (("bf16", "enabled"), "dtype", "bfloat16 turns it on"),
    (("bfloat16", "enabled"), "dtype", "bfloat16 turns it on"),
    (("fp16", "enabled"), "dtype", "float16 turns it on"),
    (("tensor_parallel", "autotp_size"), "tensor_parallel", "ranks per replica"),
    (("tensor_parallel", "tp", "tp_size"), "tensor_parallel", "ranks per replica"),
    (("tensor_parallel", "tensor_parallel", "tp_size"), "tensor_parallel", "ranks per replica"),
    (("optimizer",), "training.optimizer", "llmrl builds the optimizer: type adam, adamw or sgd, lr, ..."),
    (("scheduler",), "training.lr_schedule", "llmrl builds the schedule: constant, linear or cosine, with warmup"),
)
# sections of training.deepspeed that llmrl fills itself: only a mapping (of the sub-keys it does not own) merges
DEEPSPEED_SECTIONS = {"zero_optimization": "training.zero_stage", "bf16": "dtype", "bfloat16": "dtype",
                      "fp16": "dtype", "tensor_parallel": "tensor_parallel"}

# which options each type reads (engine/model/training/optimizer.py: make_optimizer)
OPTIMIZER_READS = {"adam": {"betas", "eps"}, "adamw": {"betas", "eps"}, "sgd": {"momentum"}}
# engine/model/training/lr_schedule.py: multiplier (warmup_steps is read by every type)
_DECAY = {"total_steps", "min_lr_ratio"}
SCHEDULE_READS = {"constant": set(), "linear": _DECAY, "cosine": _DECAY}
# engine/model/store/loading.py: _construct (bitsandbytes' bnb_4bit_* settings)
QUANTIZATION_READS = {4: {"quant_type", "compute_dtype", "double_quant"}, 8: set()}


def deepspeed_problems(at: str, extra) -> list[Problem]:
    """The entries of ``training.deepspeed`` (``extra``) of the LLM at ``at`` that override a key llmrl owns."""
    problems: list[Problem] = []
    where = f"{at}.training.deepspeed"
    for section, owner in DEEPSPEED_SECTIONS.items():
        if section in extra and not isinstance(extra[section], dict):
            problems.append((f"{where}.{section}",
                             f"must be a mapping of the {section} keys llmrl does not set (it would replace the whole "
                             f"section llmrl builds from {at}.{owner}); got {type(extra[section]).__name__}"))
    for path, owner, hint in DEEPSPEED_OWNED:
        node = extra
        for part in path:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is _MISSING:
            continue
        dotted = ".".join(path)
        others = (f"; the other {path[0]} keys stay allowed here" if len(path) > 1 else "")
        problems.append((f"{where}.{dotted}",
                         f"{dotted!r} cannot be set in {where}: llmrl sets it from {at}.{owner} ({hint}), which its "
                         f"own checks and scheduling keep reading, so a different value here would silently disagree "
                         f"with them; set {at}.{owner} instead{others}"))
    return problems


def inapplicable_problems(at: str, llm: dict) -> list[Problem]:
    """Options of the LLM at ``at`` that its optimizer, learning-rate schedule or quantization type does not read."""
    problems: list[Problem] = []
    training = llm.get("training") or {}
    optimizer = training.get("optimizer") or {}
    optimizer_type = given_or_default(optimizer, "optimizer", "type")
    problems += _unread(f"{at}.training.optimizer", "optimizer", optimizer, optimizer_type, OPTIMIZER_READS)
    schedule = training.get("lr_schedule") or {}
    if schedule:
        problems += _unread(f"{at}.training.lr_schedule", "schedule", schedule, schedule["type"], SCHEDULE_READS)
    quantization = llm.get("quantization") or {}
    if quantization:
        problems += _unread(f"{at}.quantization", "quantization", quantization, quantization["bits"],
                            QUANTIZATION_READS)
    return problems


def _unread(where: str, what: str, given: dict, chosen, reads: dict) -> list[Problem]:
    """One problem per key of ``given`` that some type of ``reads`` reads but ``chosen`` does not."""
    problems = []
    for key in sorted(set().union(*reads.values()) - reads[chosen]):
        if key not in given:
            continue
        readers = [str(t) for t, keys in reads.items() if key in keys]
        label = f"{chosen}-bit {what}" if what == "quantization" else f"the {chosen} {what}"
        kind = "bits" if what == "quantization" else "type"
        readers_text = " or ".join(f"{kind}: {t}" for t in readers)
        problems.append((f"{where}.{key}",
                         f"{label} does not read {key} (only {readers_text} reads it{_what_it_is(key)}), so it "
                         f"would be silently ignored: remove it, or choose {readers_text}"))
    return problems


def _what_it_is(key: str) -> str:
    return {"total_steps": ": the step where the decay ends", "min_lr_ratio": ": the floor of the decay",
            "quant_type": ": bitsandbytes' 4-bit data type", "compute_dtype": ": the 4-bit layers' compute dtype",
            "double_quant": ": 4-bit nested quantization", "momentum": ": SGD's momentum",
            "betas": ": Adam's moment decay rates", "eps": ": Adam's denominator term"}.get(key, "")


_MISSING = object()
