"""The typed, frozen shape of a validated config.

Every default comes from ``engine/config/schema.json``, the one place it is written: each field below reads its
key's ``default`` there through :func:`~llmrl.engine.config.reference.schema_field` (a key the schema requires has no
default here either). ``load_config`` (in :mod:`llmrl.engine.config.loading`) builds these objects from a mapping that
has passed the JSON Schema; it passes only the keys a user wrote, so the schema's defaults are the only ones.

This module holds data classes, their derived properties and :meth:`PluginSpec.coerce` (the forms a plugin may
be given in, refused with a TypeError otherwise); it does no loading, no validation of values, no heavy imports
(the schema is read with ``json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmrl.engine.config.reference import TOP_LEVEL, schema_field


@dataclass(frozen=True)
class PluginSpec:
    """A plugin: an entry-point name, ``module:attr`` or ``__main__:Name``, and its constructor's arguments."""

    plugin: str
    args: dict[str, Any] = schema_field("plugin", "args")

    @classmethod
    def coerce(cls, value, what: str = "plugin") -> PluginSpec:
        """A spec from what a config or a script may give: a name, ``{plugin, args}``, a class, or
        ``(class or name, args)``. A class becomes ``module:QualifiedName``."""
        if isinstance(value, PluginSpec):
            return value
        args: dict = {}
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
            value, args = value
        if isinstance(value, dict) and "plugin" in value:
            return cls(str(value["plugin"]), dict(value.get("args") or {}))
        if isinstance(value, str):
            return cls(value, dict(args))
        if isinstance(value, type):
            return cls(f"{value.__module__}:{value.__qualname__}", dict(args))
        raise TypeError(f"{what} must be a plugin name, a class, a (class, args) pair or {{plugin, args}}, "
                        f"got {type(value).__name__}")


@dataclass(frozen=True)
class QuantizationConfig:
    bits: int = schema_field("quantization", "bits")
    quant_type: str = schema_field("quantization", "quant_type")
    compute_dtype: str = schema_field("quantization", "compute_dtype")
    double_quant: bool = schema_field("quantization", "double_quant")


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = schema_field("optimizer", "type")
    lr: float = schema_field("optimizer", "lr")
    weight_decay: float = schema_field("optimizer", "weight_decay")
    betas: tuple[float, float] = schema_field("optimizer", "betas")
    eps: float = schema_field("optimizer", "eps")
    momentum: float = schema_field("optimizer", "momentum")


@dataclass(frozen=True)
class LRSchedule:
    """``training.lr_schedule`` (the formulas: :mod:`llmrl.engine.model.training.lr_schedule`)."""

    type: str = schema_field("lr_schedule", "type")
    warmup_steps: int = schema_field("lr_schedule", "warmup_steps")
    total_steps: int | None = schema_field("lr_schedule", "total_steps")
    min_lr_ratio: float = schema_field("lr_schedule", "min_lr_ratio")


@dataclass(frozen=True)
class TrainingConfig:
    zero_stage: int = schema_field("training", "zero_stage")
    zero3_gather_mb: int = schema_field("training", "zero3_gather_mb")
    optimizer: OptimizerConfig = schema_field("training", "optimizer", OptimizerConfig)
    micro_batch_size: int = schema_field("training", "micro_batch_size")
    gradient_accumulation_steps: int = schema_field("training", "gradient_accumulation_steps")
    max_tokens_per_micro_batch: int | None = schema_field("training", "max_tokens_per_micro_batch")
    gradient_checkpointing: bool | None = schema_field("training", "gradient_checkpointing")
    gradient_clipping: float = schema_field("training", "gradient_clipping")
    lr_schedule: LRSchedule | None = schema_field("training", "lr_schedule")
    deepspeed: dict[str, Any] = schema_field("training", "deepspeed")


@dataclass(frozen=True)
class GenerationSettings:
    """``llms.<name>.generation``: the loop that runs ``generate`` (:mod:`llmrl.engine.model.decoding`)."""

    decoder: str = schema_field("generation", "decoder")
    merge_adapter: bool | str = schema_field("generation", "merge_adapter")
    compile: bool | str = schema_field("generation", "compile")
    static_cache: bool | str = schema_field("generation", "static_cache")
    length_bucket: int = schema_field("generation", "length_bucket")
    attention_window: int = schema_field("generation", "attention_window")
    cache_mb: float = schema_field("generation", "cache_mb")
    sampler: str = schema_field("generation", "sampler")
    pack_weights: bool | str = schema_field("generation", "pack_weights")
    llama_step: bool | str = schema_field("generation", "llama_step")
    keep_gathered: bool | str = schema_field("generation", "keep_gathered")


@dataclass(frozen=True)
class LLMConfig:
    name: str
    model: str
    tokenizer: str | None = schema_field("llm", "tokenizer")
    type: str = schema_field("llm", "type")
    backend: str = schema_field("llm", "backend")
    from_pretrained: bool = schema_field("llm", "from_pretrained")
    dtype: str = schema_field("llm", "dtype")
    replicas: int = schema_field("llm", "replicas")
    tensor_parallel: int = schema_field("llm", "tensor_parallel")
    devices: str | tuple[int, ...] = schema_field("llm", "devices")
    minibatch_size: int = schema_field("llm", "minibatch_size")
    token_budget: int = schema_field("llm", "token_budget")
    max_length: int | None = schema_field("llm", "max_length")
    prefix_reuse: bool = schema_field("llm", "prefix_reuse")
    kv_cache_mb: float = schema_field("llm", "kv_cache_mb")
    trunk_reuse_mb: float = schema_field("llm", "trunk_reuse_mb")
    max_run_time_adapters: int = schema_field("llm", "max_run_time_adapters")
    run_time_adapters_mb: float = schema_field("llm", "run_time_adapters_mb")
    trust_remote_code: bool = schema_field("llm", "trust_remote_code")
    revision: str | None = schema_field("llm", "revision")
    model_kwargs: dict[str, Any] = schema_field("llm", "model_kwargs")
    pad_token_id: int | None = schema_field("llm", "pad_token_id")
    quantization: QuantizationConfig | None = schema_field("llm", "quantization")
    initializers: tuple[PluginSpec, ...] = schema_field("llm", "initializers")
    heads: dict[str, PluginSpec] = schema_field("llm", "heads")
    updater: PluginSpec | None = schema_field("llm", "updater")
    trainable: bool | None = schema_field("llm", "trainable")
    training: TrainingConfig = schema_field("llm", "training", TrainingConfig)
    generation: GenerationSettings = schema_field("llm", "generation", GenerationSettings)
    checkpoint: str | None = schema_field("llm", "checkpoint")

    @property
    def num_ranks(self) -> int:
        return self.replicas * self.tensor_parallel

    @property
    def on_gpu(self) -> bool:
        return self.devices != "cpu"

    @property
    def lockstep(self) -> bool:
        """Whether every replica must take part in every request. With ZeRO-3 the replicas hold one partitioned
        copy of the weights, so every forward gathers from all of them: each replica makes the same number of
        model calls (padding with throw-away calls), even one with nothing to do."""
        return self.training.zero_stage == 3 and self.replicas > 1


@dataclass(frozen=True)
class Timeouts:
    startup: float = schema_field("timeouts", "startup")
    request: float | None = schema_field("timeouts", "request")
    heartbeat: float = schema_field("timeouts", "heartbeat")
    dead_after: float = schema_field("timeouts", "dead_after")
    collective: float = schema_field("timeouts", "collective")
    shutdown: float = schema_field("timeouts", "shutdown")


@dataclass(frozen=True)
class TrackingConfig:
    """``tracking``: where the run's scalars go (the writers, and the names ``backends`` may hold:
    :mod:`llmrl.engine.client.tracking.registry`)."""

    backends: tuple[str, ...] = schema_field("tracking", "backends")
    dir: str = schema_field("tracking", "dir")
    run_name: str | None = schema_field("tracking", "run_name")
    project: str = schema_field("tracking", "project")
    server_stats_every: int = schema_field("tracking", "server_stats_every")


@dataclass(frozen=True)
class Config:
    llms: dict[str, LLMConfig]
    seed: int = schema_field(TOP_LEVEL, "seed")
    threads_per_rank: int | None = schema_field(TOP_LEVEL, "threads_per_rank")
    host_malloc: str = schema_field(TOP_LEVEL, "host_malloc")
    cpu_matmul: str = schema_field(TOP_LEVEL, "cpu_matmul")
    log_level: str = schema_field(TOP_LEVEL, "log_level")
    max_message_bytes: int = schema_field(TOP_LEVEL, "max_message_bytes")
    timeouts: Timeouts = schema_field(TOP_LEVEL, "timeouts", Timeouts)
    tracking: TrackingConfig = schema_field(TOP_LEVEL, "tracking", TrackingConfig)
    source: str | None = None  # the file the config was read from (not a config key)

    @property
    def default_llm(self) -> str:
        return next(iter(self.llms))

    @property
    def num_server_ranks(self) -> int:
        return sum(llm.num_ranks for llm in self.llms.values())

    @property
    def world_size(self) -> int:
        """Ranks the launcher must start: the client (rank 0) plus every server rank."""
        return 1 + self.num_server_ranks
