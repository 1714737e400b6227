"""The Hugging Face + DeepSpeed backend: a transformers model and its heads inside a DeepSpeed engine.

Start-up: :meth:`HFBackend.load` reads the tokenizer and weights (ZeRO-3 partitions them while they load,
bitsandbytes quantises them); :meth:`prepare` applies the initializers (LoRA, freeze, ...) and builds the
heads and the updater with the same seed on every replica, so that they start identical; :meth:`build`
wraps the model and heads (:class:`~llmrl.engine.model.module.ModelWithHeads`) in a DeepSpeed engine, with
an optimizer only when the LLM has an updater, and restores a checkpoint if the config names one.

Requests run on the engine: forward passes through :mod:`llmrl.engine.model.forward`, generation through
:mod:`llmrl.engine.model.generation` (on the engine's own module, so weights are always current), updates
through :mod:`llmrl.engine.model.training.trainer`, checkpoints through :mod:`llmrl.engine.model.checkpoint`.

This module does not talk to the client or decide what a request returns; the request kinds do.
"""

from __future__ import annotations

import random

import torch

from llmrl.engine.errors import PeerAborted, PluginError, plugin_error
from llmrl.engine.model.backend import ModelBackend
from llmrl.engine.model.forward import forget_zero3_trace, plan_and_agree, plan_forward, run_forward
from llmrl.engine.model.hf_startup import decoder_start_id, make_prefix_cache, make_trunk, num_hidden_states
from llmrl.engine.model.served import ServedModel
from llmrl.engine.model.version_counts import share_staleness, stamped, update_staleness, version_of
from llmrl.engine.model.zero3_gather import gathered_weights, gathers_whole


class HFBackend(ModelBackend):
    """Hugging Face transformers (plus PEFT and bitsandbytes) inside a DeepSpeed engine."""

    tokenizer = None
    model = None
    served: ServedModel | None = None
    prefix_cache = None  # a PrefixKVCache when llms.<name>.kv_cache_mb > 0

    # ------------------------------------------------------------------ start-up

    def load(self) -> None:
        from llmrl.engine.model.deepspeed_config import build_deepspeed_config
        from llmrl.engine.model.store.loading import (
            load_model,
            load_tokenizer,
            max_input_length,
            set_pad_token,
        )

        self.tokenizer = load_tokenizer(self.llm)
        self.ds_config = build_deepspeed_config(self.llm)
        self.model, self._keepalive = load_model(self.llm, self.device, self.ds_config)
        if self.llm.pad_token_id is not None:  # checked against the model's vocabulary too
            set_pad_token(self.tokenizer, self.llm, self.model.config.get_text_config().vocab_size)
        self.max_length = max_input_length(self.model, self.tokenizer, self.llm)

    def prepare(self, script_plugins: dict) -> None:
        from llmrl.engine.config import PluginSpec
        from llmrl.engine.model.module import ModelWithHeads
        from llmrl.engine.model.scoring.context_logits import context_logits_problem
        from llmrl.plugins import registry
        from llmrl.plugins.checks import check_head_layers
        from llmrl.plugins.contracts import LLMInfo

        text_config = self.model.config.get_text_config()
        self.info = LLMInfo(name=self.llm.name, kind=self.llm.type, hidden_size=text_config.hidden_size,
                            vocab_size=text_config.vocab_size, dtype=getattr(torch, self.llm.dtype),
                            device=self.device, hf_config=self.model.config, tokenizer=self.tokenizer)
        _seed(self.config.seed)  # identical adapters and heads on every replica
        model = self.model
        for spec in [*self.llm.initializers, *script_plugins.get("initializers", [])]:
            initializer = registry.build("initializer", spec)
            try:
                model = initializer.initialize(model, self.info)
            except Exception as err:
                raise plugin_error(f"initializer {spec.plugin!r} failed: {type(err).__name__}: {err}",
                                   spec.plugin) from err
            if not isinstance(model, torch.nn.Module):
                raise plugin_error(f"initializer {spec.plugin!r} returned {type(model).__name__}, not the model: "
                                   "initialize(model, llm) must return the model (changed or not)", spec.plugin)
        self.model = model
        self.adapters = sorted(getattr(model, "peft_config", {}) or {})
        self.head_specs = {**self.llm.heads, **script_plugins.get("heads", {})}
        _seed(self.config.seed + 1)
        heads = {key: registry.build("head", spec, llm=self.info).to(self.device)
                 for key, spec in self.head_specs.items()}
        depth = num_hidden_states(self.model, self.llm.type)
        for key, head in heads.items():
            problem = check_head_layers(type(head), self.head_specs[key].plugin, depth)
            if problem is None and getattr(head, "needs_context_logits", False):
                problem = context_logits_problem(self.model)
                problem = problem and f"head {key!r} ({self.head_specs[key].plugin}) needs_context_logits: {problem}"
            if problem:
                raise plugin_error(problem, self.head_specs[key].plugin)
            scalars = [name for name, p in head.named_parameters() if p.dim() == 0]
            if scalars:
                raise plugin_error(f"head {key!r} ({self.head_specs[key].plugin}) has 0-dimensional parameter(s) "
                                   f"{scalars}; DeepSpeed cannot broadcast those: give them shape (1,)",
                                   self.head_specs[key].plugin)
        updater_spec = script_plugins.get("updater") or self.llm.updater
        updater_spec = PluginSpec.coerce(updater_spec) if updater_spec else None
        self.updater = registry.build("updater", updater_spec) if updater_spec else None
        self.updater_name = updater_spec.plugin if updater_spec else None
        start_id = decoder_start_id(self.model)
        self.module = ModelWithHeads(self.model, heads, self.llm.type, self.tokenizer.pad_token_id, start_id,
                                     {key: spec.plugin for key, spec in self.head_specs.items()})
        self.trainable = self.llm.trainable if self.llm.trainable is not None else self.updater is not None
        if self.trainable and not any(p.requires_grad for p in self.module.parameters()):
            why = "an updater" if self.updater is not None else "trainable: true"
            raise PluginError(f"LLM {self.llm.name!r} has {why} but no trainable parameter "
                              "(did an initializer freeze everything?)")
        from llmrl.engine.model.reuse.trunk import trunk_depth

        self.trunk_depth = trunk_depth(self.model) if self.llm.type == "causal" else 0

    def build(self) -> dict:
        from llmrl.engine.model.tp_lora import built_engine
        from llmrl.engine.model.training.lr_schedule import make_scheduler
        from llmrl.engine.model.training.optimizer import AdapterSteps, make_optimizer

        optimizer = adapter_steps = schedule = None
        if self.trainable:
            optimizer = make_optimizer(self.module, self.adapters, self.llm.training.optimizer)
            schedule = make_scheduler(optimizer, self.llm.training.lr_schedule)  # (before AdapterSteps wraps step)
            adapter_steps = AdapterSteps(optimizer)
        else:
            self.module.requires_grad_(False)
        ds_config = dict(self.ds_config)
        if optimizer is None and self.llm.training.zero_stage in (1, 2):
            ds_config["zero_optimization"] = {**ds_config["zero_optimization"], "stage": 0}
        engine = built_engine(self.module, self.llm.tensor_parallel, optimizer=optimizer, config=ds_config,
                              lr_scheduler=schedule, dist_init_required=False)
        engine.eval()
        self.served = ServedModel(
            llm=self.llm, role=self.role, device=self.device, group=self.group, info=self.info,
            tokenizer=self.tokenizer, engine=engine, max_length=self.max_length, adapters=self.adapters,
            head_specs=self.head_specs, updater=self.updater, updater_name=self.updater_name,
            adapter_steps=adapter_steps)
        if self.llm.checkpoint:
            from llmrl.engine.model.checkpoint import load_checkpoint

            load_checkpoint(self.served, self.llm.checkpoint)
            self.weights_changed()
        if self.llm.kv_cache_mb > 0:
            self.prefix_cache = make_prefix_cache(self.model, self.llm)
        if self.llm.trunk_reuse_mb > 0:
            self.module.trunk = make_trunk(self.model, self.llm, self.trunk_depth, self.trainable)
        self.checkpointed_layers = 0
        checkpointing = self.llm.training.gradient_checkpointing
        if self.trainable and (checkpointing if checkpointing is not None else self.device.type == "cuda"):
            from llmrl.engine.model.training.checkpointing import enable_checkpointing

            self.checkpointed_layers = enable_checkpointing(self.model)
        return self.describe()

    def describe(self) -> dict:
        params = list(self.module.parameters())
        return {
            "llm": self.llm.name,
            "kind": self.llm.type,
            "backend": self.llm.backend,
            "heads": {k: type(h).level for k, h in self.module.heads.items()},
            "adapters": self.adapters,
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "max_length": self.max_length,
            "vocab_size": self.info.vocab_size,
            "pad_token_id": self.module.pad_id,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "device": str(self.device),
            "dtype": self.llm.dtype,
            "updater": type(self.updater).__name__ if self.updater else None,
            "per_sample": getattr(self.updater, "per_sample_args", None),
            "whole_args": getattr(self.updater, "whole_args", None),
            "kv_cache_mb": self.llm.kv_cache_mb,
            "checkpointed_layers": self.checkpointed_layers,
        }

    # ------------------------------------------------------------------ requests

    def score(self, request):
        plan, extra = plan_and_agree(self.served, request.contexts, request.candidates, request.heads,
                                     request.peft_adapter, request.minibatch_size, must_agree=self.llm.lockstep,
                                     prefix_cache=self.prefix_cache, per_token=request.per_token,
                                     entropy=request.entropy, add_eos=request.add_eos, head_kwargs=request.head_kwargs)
        with torch.no_grad(), self.served.adapter(plan.adapter), \
                gathered_weights(self.served.engine, self.llm.training.zero3_gather_mb):  # a snapshot before the gather
            return run_forward(self.served, plan, extra, prefix_cache=self.prefix_cache, trunk_mode="record")

    def tokenize(self, request):
        return plan_forward(self.served, request.contexts, request.candidates).plan

    def generate(self, request):
        import contextlib
        from dataclasses import replace

        from llmrl.engine.model.generation import generate, plan_generate
        from llmrl.engine.model.row_adapters import row_adapters_for
        from llmrl.engine.model.weight_sync import writes_between_batches

        served, llm, rows = self.served, self.llm, None
        kwargs, steering = dict(request.kwargs or {}), None
        try:
            adapter, rows = row_adapters_for(served, request.peft_adapter, len(request.contexts))
            if isinstance(request.peft_adapter, list) and llm.lockstep and \
                    not gathers_whole(served.engine, llm.training.zero3_gather_mb):  # (voted on below)
                raise ValueError(f"LLM {llm.name!r} runs ZeRO-3 layer by layer in lockstep (its weights exceed "
                                 "training.zero3_gather_mb), where every rank must run the same adapters: give "
                                 "generate one peft_adapter per call, or raise zero3_gather_mb")
            served.check_adapter(adapter)
            if kwargs.get("steer") not in (None, False):  # the updater's own policy (plugins/steering.py)
                if rows is not None:
                    raise ValueError("steer reads one adapter's policy: give generate one peft_adapter, not a list")
                steering = self._steering(kwargs.pop("steer"), adapter)
                kwargs["logits_processor"] = [*kwargs.get("logits_processor", []), steering]
            kwargs.pop("steer", None)
            plan, error = plan_generate(served.model, self.tokenizer, llm.type, request.contexts, kwargs,
                                        llm.token_budget, request.minibatch_size or llm.minibatch_size,
                                        self.max_length, vocab_size=self.info.vocab_size), None
            plan = replace(plan, row_adapters=rows)
        except Exception as err:  # noqa: BLE001 - under lockstep, voted on first
            plan, error = None, err
            if steering is not None:
                steering.close()
        extra = 0
        if llm.lockstep:  # every replica calls generate as often as the busiest, or none does
            count = len(plan.batches) if plan is not None else 0
            everyone_ok, most = self.group.agree(error is None, count)
            if error is None and not everyone_ok:
                raise PeerAborted(f"another rank of LLM {llm.name!r} refused its share of the request")
            extra = most - count
        if error is not None:
            raise error
        with torch.no_grad(), served.adapter(adapter), \
                gathered_weights(served.engine, llm.training.zero3_gather_mb) as whole, \
                rows.hooked(served.model, gathers_whole(served.engine, 0) or whole) if rows is not None \
                else contextlib.nullcontext():
            if llm.lockstep and not whole:
                forget_zero3_trace(served.engine)
            use = None  # (a steered step reads the whole prompt; the cache holds one adapter's keys per prompt)
            if self.prefix_cache is not None and steering is None and rows is None:
                from llmrl.engine.model.reuse.prefix_cache import CacheUse

                use = CacheUse(self.prefix_cache, adapter or served.active_adapter())
            between = writes_between_batches(served, adapter, self.queued_write_taker) if not llm.lockstep and \
                not whole and steering is None and not plan.prompt_logprobs and rows is None else None
            try:
                return stamped(generate(served.model, self.tokenizer, llm.type, plan, self.device,
                                        lockstep=extra if llm.lockstep else None, seed=request.seed, prefix_cache=use,
                                        decoder=self.decoder(), whole_weights=whole, between_batches=between),
                               served, adapter if rows is None else rows.names)
            finally:
                if steering is not None:
                    steering.close()

    def _steering(self, steer, adapter):
        from llmrl.engine.model.steered import steering_for

        return steering_for(self.served, self.prefix_cache, steer, adapter)

    def decoder(self):
        """The LLM's decoding loop (:class:`~llmrl.engine.model.decoding.runtime.Decoder`), made at first use."""
        if getattr(self, "_decoder", None) is None:
            from llmrl.engine.model.decoding.runtime import Decoder

            self._decoder = Decoder(self.llm.generation, torch.device(self.device).type,
                                    zero3=self.llm.training.zero_stage == 3, trunk=self.module.trunk)
        return self._decoder

    def update(self, request):
        from llmrl.engine.model.training.trainer import run_update

        try:
            versions = update_staleness(self.served, request.kwargs)  # against the weights before the update
            return {**run_update(self.served, request.batch(self.role.replica, self.llm.replicas)), **versions}
        finally:  # an update trains only what sits from the trunk's depth up (the trunk exists only then)
            trunk = self.module.trunk
            self.weights_changed(unchanged_below=trunk.depth if trunk is not None else 0)

    def forward_backward(self, request):
        from llmrl.engine.model.training.client_steps import forward_backward

        stale = share_staleness(self.served, request.adapter, request.policy_versions)
        return {**forward_backward(self.served, [seq.tokens for seq in request.sequences],
                                   [seq.inputs for seq in request.sequences], request.loss_fn, request.loss_fn_config,
                                   request.backward, request.adapters()), "staleness": stale}

    def optim_step(self, request):
        from llmrl.engine.model.training.client_steps import optim_step

        try:
            return {**optim_step(self.served, request.settings, request.adapter),
                    "policy_version": version_of(self.served, request.adapter)}
        finally:
            trunk = self.module.trunk
            self.weights_changed(unchanged_below=trunk.depth if trunk is not None else 0)

    def snapshot(self, request):
        from llmrl.engine.model.snapshots import take_snapshot

        return take_snapshot(self.served, request.name, request.source, self.prefix_cache)

    def drop_snapshot(self, request):
        from llmrl.engine.model.snapshots import drop_snapshot

        return drop_snapshot(self.served, request.name, self.prefix_cache)

    def create_adapter(self, request):
        from llmrl.engine.model.training.new_adapters import create_adapter

        return create_adapter(self.served, request.name, request.rank, request.alpha, request.seed, request.targets,
                              prefix_cache=self.prefix_cache)

    def delete_adapter(self, request):
        from llmrl.engine.model.training.new_adapters import delete_adapter

        return delete_adapter(self.served, request.name, self.prefix_cache)

    def save_adapter(self, request):
        from llmrl.engine.model.training.adapter_state import save_adapter

        return save_adapter(self.served, request.name, request.path)

    def load_adapter(self, request):
        from llmrl.engine.model.training.adapter_state import load_adapter

        return load_adapter(self.served, request.name, request.path, request.optimizer, self.prefix_cache)

    def weights_changed(self, unchanged_below: int = 0) -> None:
        """The cache across calls holds keys and values computed with the old weights: forget them. When the
        layers below ``unchanged_below`` kept their weights (an update, all of whose trainable parameters sit from
        the trunk's depth up), their keys and values are still exact: with frozen-trunk reuse, which keeps the
        hidden states entering that layer, the cache keeps them and recomputes the layers above when an entry is
        next read."""
        if self.prefix_cache is None:
            return
        if unchanged_below > 0 and self.module.trunk is not None:
            self.prefix_cache.keep_layers_below(unchanged_below)
        else:
            self.prefix_cache.clear()

    def save(self, request):
        from llmrl.engine.model.checkpoint import save_shard

        save_shard(self.served, request.folder)

    def state_dict(self, request):
        from llmrl.engine.model.checkpoint import full_state_dict, own_state_dict

        state = own_state_dict(self.served) if request.own_replica else full_state_dict(self.served)
        return None if state is None else {k: v for k, v in state.items() if k.startswith(request.prefix)}

    def read_weights(self, request):
        from llmrl.engine.model.weight_sync import read_to_send

        return read_to_send(self.served, request, self.weight_channels)

    def write_weights(self, request):
        from llmrl.engine.model.weight_sync import write_sent

        return write_sent(self.served, request, self.weight_channels, self.prefix_cache)

    def memory(self, request):
        import resource

        import psutil

        from llmrl.engine.model import cpu_matmul

        info = psutil.Process().memory_info()
        out = {"rss": info.rss, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
            out["cuda_peak"] = torch.cuda.max_memory_allocated(self.device)
        params = self.served.module.parameters() if self.served else self.model.parameters() if self.model else []
        out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in params)
        if self.prefix_cache is not None:
            out["kv_cache"] = self.prefix_cache.stats()
        if self.served is not None and self.served.module.trunk is not None:
            out["trunk"] = self.served.module.trunk.stats()
        out["checkpointed_layers"] = getattr(self, "checkpointed_layers", 0)
        out["updater_bytes"] = getattr(self.updater, "held_bytes", int)()  # tensors an updater keeps (ilql's copies)
        out["cpu_matmul"] = cpu_matmul.stats()  # whether frozen products run through oneDNN, and how many did
        if getattr(self, "_decoder", None) is not None:  # generate batches per loop, merges and compiled shapes
            out["decoding"] = self._decoder.stats()
        if self.served is not None and self.llm.training.zero_stage == 3:
            out["zero3_gathered_calls"] = getattr(self.served.engine, "llmrl_gathered_calls", 0)
        if self.served is not None and (self.served.run_time.snapshots or self.served.run_time.created):
            from llmrl.engine.model.snapshots import snapshots_report

            out["snapshots"] = snapshots_report(self.served)
            out["created_adapters"] = list(self.served.run_time.created)
        return out


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
