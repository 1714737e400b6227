"""The typed, frozen shape of a validated config. Every default is written here, once.

``load_config`` (in :mod:`llmrl.engine.config.loading`) builds these objects from a mapping that has
passed the JSON Schema; it passes only the keys a user wrote, so the defaults below are the only ones.

This module holds data classes, their derived properties and :meth:`PluginSpec.coerce` (the forms a plugin may
be given in, refused with a TypeError otherwise); it does no loading, no validation of values, no heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PluginSpec:
    """A plugin: an entry-point name, ``module:attr`` or ``__main__:Name``, and its constructor's arguments."""

    plugin: str
    args: dict[str, Any] = field(default_factory=dict)

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
    bits: int = 4
    quant_type: str = "nf4"
    compute_dtype: str = "float32"
    double_quant: bool = False


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adam"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0


@dataclass(frozen=True)
class LRSchedule:
    """``training.lr_schedule`` (the formulas: :mod:`llmrl.engine.model.training.lr_schedule`)."""

    type: str = "constant"  # constant, linear or cosine
    warmup_steps: int = 0
    total_steps: int | None = None  # linear and cosine: the step where the decay ends
    min_lr_ratio: float = 0.0  # linear and cosine: the floor, as a fraction of the optimizer's lr


@dataclass(frozen=True)
class TrainingConfig:
    zero_stage: int = 0
    zero3_gather_mb: int = 4096  # ZeRO-3: weights gathered once per inference call up to this size (0: per layer)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_tokens_per_micro_batch: int | None = None  # None: the LLM's token_budget
    gradient_checkpointing: bool | None = None  # None: on for CUDA devices, off on CPU
    gradient_clipping: float = 0.0
    lr_schedule: LRSchedule | None = None
    deepspeed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationSettings:
    """``llms.<name>.generation``: the loop that runs ``generate`` (:mod:`llmrl.engine.model.decoding`)."""

    decoder: str = "auto"  # auto: llmrl's loop where it applies, else Hugging Face's; hf; llmrl (refuse the rest)
    merge_adapter: bool | str = "auto"  # the active LoRA adapter merged into sampling weights; auto: on CUDA
    compile: bool | str = "auto"  # capture the decode step (torch.compile, CUDA graphs); auto: on CUDA
    static_cache: bool | str = "auto"  # a preallocated cache of bucketed shape; auto: when compiling
    length_bucket: int = 256  # cache lengths are rounded up to a multiple of this
    attention_window: int = 64  # static-cache steps attend over the filled columns rounded up to this (0: all; >= 16)
    cache_mb: float = 8192  # the loop's key/value cache per batch (bounds rows x (prompt + new tokens))
    sampler: str = "multinomial"  # how the loop draws samples: multinomial (Hugging Face's draws) or inverse_cdf
    pack_weights: bool | str = "auto"  # decode steps multiply with packed weights (mkl, onednn; auto: by CPU) on CPU
    llama_step: bool | str = "auto"  # Llama-shaped models' decode steps as plain tensor code; auto: on CPU
    keep_gathered: bool | str = "auto"  # ZeRO-3: the weights a decode step reads kept between calls; auto: if compiled


@dataclass(frozen=True)
class LLMConfig:
    name: str
    model: str
    tokenizer: str | None = None
    type: str = "causal"
    backend: str = "hf"
    from_pretrained: bool = True
    dtype: str = "float32"
    replicas: int = 1
    tensor_parallel: int = 1
    devices: str | tuple[int, ...] = "cpu"
    minibatch_size: int = 64
    token_budget: int = 8192
    max_length: int | None = None
    prefix_reuse: bool = True
    kv_cache_mb: float = 0.0
    trunk_reuse_mb: float = 0.0
    max_run_time_adapters: int = 64  # adapters created at run time and snapshots held at once (model/adapter_caps.py)
    run_time_adapters_mb: float = 16384.0  # their weights together, in MB
    trust_remote_code: bool = False
    revision: str | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    pad_token_id: int | None = None
    quantization: QuantizationConfig | None = None
    initializers: tuple[PluginSpec, ...] = ()
    heads: dict[str, PluginSpec] = field(default_factory=dict)
    updater: PluginSpec | None = None
    trainable: bool | None = None  # None: trained when it has an updater
    training: TrainingConfig = field(default_factory=TrainingConfig)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    checkpoint: str | None = None

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
    startup: float = 600.0
    request: float | None = 3600.0
    heartbeat: float = 1.0
    dead_after: float = 20.0
    collective: float = 1800.0
    shutdown: float = 30.0


TRACKING_BACKENDS = ("csv", "tensorboard", "trackio", "wandb", "mlflow")
# the module each tracking back end imports, and the install that provides it (csv needs none)
TRACKING_PACKAGES = {"tensorboard": ("tensorboard", "pip install 'llmrl[tracking]'"),
                     "trackio": ("trackio", "pip install 'llmrl[tracking-all]' (or pip install trackio)"),
                     "wandb": ("wandb", "pip install 'llmrl[tracking-all]' (or pip install wandb)"),
                     "mlflow": ("mlflow", "pip install 'llmrl[tracking-all]' (or pip install mlflow-skinny)")}


@dataclass(frozen=True)
class TrackingConfig:
    """``tracking``: where the run's scalars go (the writers: :mod:`llmrl.engine.client.tracking`)."""

    backends: tuple[str, ...] = ()  # some of TRACKING_BACKENDS; none: nothing is written
    dir: str = "runs"  # each run writes under <dir>/<run_name> (MLflow's store: <dir>/mlruns, trackio's: <dir>/trackio)
    run_name: str | None = None  # None: <script name>-<date>-<time>
    project: str = "llmrl"  # the W&B / MLflow (experiment) / trackio project
    server_stats_every: int = 1  # updates between two reports of the servers' memory and cache; 0: never


@dataclass(frozen=True)
class Config:
    llms: dict[str, LLMConfig]
    seed: int = 0
    threads_per_rank: int | None = None
    host_malloc: str = "reuse"  # reuse: server ranks keep freed host memory for the next tensor (server/host_memory)
    cpu_matmul: str = "auto"  # frozen float32 products of passes on a CPU: torch's (MKL) or oneDNN's; auto: by vendor
    log_level: str = "info"
    max_message_bytes: int = 4 << 30
    timeouts: Timeouts = field(default_factory=Timeouts)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    source: str | None = None

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
