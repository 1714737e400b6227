"""One server rank's model: the Hugging Face model with its heads, inside a DeepSpeed engine.

:class:`ModelWithHeads` is the module DeepSpeed wraps: its forward runs the whole scoring pipeline
of :mod:`llmrl.engine.scoring` (prefix pass, candidate passes, heads) so that one engine call covers
one request batch or one training micro-batch. :class:`LLMRuntime` loads the model, applies the
initializers, builds the heads (seeded identically on every replica), builds the engine (with an
optimizer only when the LLM has an updater), and serves ``score``, ``generate``, ``update`` and
``save`` for this rank's share of a request.

With ZeRO-3 and several replicas every forward gathers weights from all replicas, so every replica
must make the same number of model calls: such requests run in *lockstep*, each rank padding its
work with throw-away calls to the group's maximum.

This module does not talk to the client; :mod:`llmrl.engine.server` does.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch

from llmrl.engine.config import Config, LLMConfig
from llmrl.engine.errors import PluginError
from llmrl.engine.scoring import (
    BatchSpec,
    Needs,
    accepts_logits_to_keep,
    causal_calls,
    plan_batches,
    run_batch,
)
from llmrl.engine.tokenization import TokenPlan, tokenize
from llmrl.engine.topology import RankRole


class ModelWithHeads(torch.nn.Module):
    """The served model and its heads; ``forward`` scores a planned request and runs the named heads."""

    def __init__(self, model, heads: dict, kind: str, pad_id: int, start_id: int | None, prefix_reuse: bool,
                 head_plugins: dict[str, str] | None = None):
        super().__init__()
        self.model = model
        self.heads = torch.nn.ModuleDict(heads)
        self.head_plugins = dict(head_plugins or {})
        self.kind = kind
        self.pad_id = pad_id
        self.start_id = start_id
        self.prefix_reuse = prefix_reuse
        self.keep_logits = kind == "causal" and accepts_logits_to_keep(model)

    def forward(self, plan: TokenPlan, batches: list[BatchSpec], needs: Needs, head_keys: tuple = (),
                extra_calls: int = 0) -> dict[str, torch.Tensor]:
        from llmrl.plugins.contracts import ForwardOutputs

        device = self.device
        results = [run_batch(self.model, plan, b, needs, self.pad_id, device, self.keep_logits, self.start_id,
                             self.prefix_reuse) for b in batches]
        # Put candidates (and contexts) back in request order.
        ctx_order = [i for b in batches for i in b.contexts]
        starts = _candidate_starts(plan)
        cand_order = [starts[i] + j for i in ctx_order for j in range(len(plan.contexts[i].candidates))]
        n_cand, n_ctx = starts[-1], len(plan.contexts)
        cand_perm = _inverse(cand_order, n_cand, device)
        ctx_perm = _inverse(ctx_order, n_ctx, device)
        scores = _cat([r.scores for r in results], (0,), device)[cand_perm] if n_cand else torch.zeros(0, device=device)
        counts = _cat([r.counts for r in results], (0,), "cpu", torch.long)[cand_perm.cpu()]
        context_of = torch.tensor([i for i, c in enumerate(plan.contexts) for _ in c.candidates], dtype=torch.long)
        outputs = ForwardOutputs(kind=self.kind, num_contexts=n_ctx, candidate_scores=scores,
                                 candidate_token_counts=counts, candidate_context=context_of.to(device))
        if needs.context_hidden:
            outputs.context_hidden = _cat([r.context_hidden for r in results], (0, self.hidden_size), device)[ctx_perm]
        if needs.candidate_hidden:
            outputs.candidate_hidden = _cat([r.candidate_hidden for r in results], (0, self.hidden_size),
                                            device)[cand_perm]
        if extra_calls:
            outputs.candidate_scores = scores + 0.0 * self._throwaway_calls(extra_calls)
        out = {"scores": outputs.candidate_scores, "counts": counts, "context_of": context_of}
        for key in head_keys:
            try:
                out[f"head:{key}"] = self.heads[key](outputs)
            except Exception as err:
                plugin = self.head_plugins.get(key, type(self.heads[key]).__name__)
                raise _plugin_error(f"head {key!r} ({plugin}) failed: {type(err).__name__}: {err}", plugin) from err
        return out

    def _throwaway_calls(self, n: int) -> torch.Tensor:
        """Model calls whose results count for nothing (lockstep padding); returns a 0-weighted sum."""
        total = torch.zeros((), device=self.device)
        token = torch.tensor([[self.pad_id]], device=self.device)
        for _ in range(n):
            if self.kind == "seq2seq":
                logits = self.model(input_ids=token, decoder_input_ids=torch.tensor([[self.start_id]], device=self.device)
                                    ).logits
            else:
                logits = self.model(input_ids=token).logits
            total = total + logits.float().sum()
        return total

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size


def _candidate_starts(plan: TokenPlan) -> list[int]:
    starts, total = [], 0
    for c in plan.contexts:
        starts.append(total)
        total += len(c.candidates)
    return starts + [total]


def _inverse(order: list[int], n: int, device) -> torch.Tensor:
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return inverse.to(device)


def _cat(parts, empty_shape, device, dtype=None) -> torch.Tensor:
    parts = [p for p in parts if p is not None]
    if not parts:
        return torch.zeros(empty_shape, device=device, dtype=dtype or torch.float32)
    return torch.cat([p.to(device) for p in parts])


def count_model_calls(plan: TokenPlan, batches: list[BatchSpec], kind: str) -> int:
    """Model calls a request makes (seq2seq in lockstep re-encodes per chunk: one call per chunk)."""
    if kind == "causal":
        return sum(causal_calls(plan, b) for b in batches)
    return sum(len(b.chunks) for b in batches)


class LLMRuntime:
    """The model side of one server rank."""

    def __init__(self, config: Config, role: RankRole, device: torch.device, control_group=None):
        self.config = config
        self.llm: LLMConfig = config.llms[role.llm]
        self.role = role
        self.device = torch.device(device)
        self.control_group = control_group
        self.lockstep = self.llm.training.zero_stage == 3 and self.llm.replicas > 1
        self.tokenizer = None
        self.model = None
        self.module: ModelWithHeads | None = None
        self.engine = None
        self.updater = None
        self.head_specs: dict = {}
        self.adapters: list[str] = []
        self._keepalive = None
        self.max_length: int | None = None
        self.info = None

    # ------------------------------------------------------------------ start-up

    def load(self) -> None:
        """Load tokenizer and weights (before the client's Caller exists, to overlap with the script)."""
        from llmrl.engine.deepspeed_config import build_deepspeed_config
        from llmrl.engine.model_loading import load_model, load_tokenizer, max_input_length

        self.tokenizer = load_tokenizer(self.llm)
        self.ds_config = build_deepspeed_config(self.llm)
        self.model, self._keepalive = load_model(self.llm, self.device, self.ds_config)
        self.max_length = max_input_length(self.model, self.tokenizer, self.llm)

    def prepare(self, script_plugins: dict) -> None:
        """Apply the initializers and build heads and updater: local work, no collective."""
        from llmrl.engine.config import PluginSpec
        from llmrl.plugins import registry
        from llmrl.plugins.contracts import LLMInfo

        text_config = self.model.config.get_text_config()
        self.info = LLMInfo(name=self.llm.name, kind=self.llm.type, hidden_size=text_config.hidden_size,
                            vocab_size=text_config.vocab_size, dtype=getattr(torch, self.llm.dtype), device=self.device,
                            hf_config=self.model.config, tokenizer=self.tokenizer)
        self._seed(self.config.seed)  # identical adapters and heads on every replica
        model = self.model
        for spec in list(self.llm.initializers) + list(script_plugins.get("initializers", [])):
            initializer = registry.build("initializer", spec)
            try:
                model = initializer.initialize(model, self.info)
            except Exception as err:
                raise _plugin_error(f"initializer {spec.plugin!r} failed: {type(err).__name__}: {err}",
                                    spec.plugin) from err
            if model is None:
                raise _plugin_error(f"initializer {spec.plugin!r} returned None; initialize() must return the model",
                                    spec.plugin)
        self.model = model
        self.adapters = sorted(getattr(model, "peft_config", {}) or {})
        self.head_specs = {**self.llm.heads, **script_plugins.get("heads", {})}
        self._seed(self.config.seed + 1)
        heads = {key: registry.build("head", spec, llm=self.info).to(self.device)
                 for key, spec in self.head_specs.items()}
        for key, head in heads.items():
            scalars = [name for name, p in head.named_parameters() if p.dim() == 0]
            if scalars:
                raise _plugin_error(f"head {key!r} ({self.head_specs[key].plugin}) has 0-dimensional parameter(s) "
                                    f"{scalars}; DeepSpeed cannot broadcast those: give them shape (1,)",
                                    self.head_specs[key].plugin)
        updater_spec = script_plugins.get("updater") or self.llm.updater
        if isinstance(updater_spec, str):
            updater_spec = PluginSpec(updater_spec)
        self.updater = registry.build("updater", updater_spec) if updater_spec else None
        self.updater_name = updater_spec.plugin if updater_spec else None
        start_id = getattr(self.model.config, "decoder_start_token_id", None)
        prefix_reuse = self.llm.prefix_reuse and not (self.lockstep and self.llm.type == "seq2seq")
        self.module = ModelWithHeads(self.model, heads, self.llm.type, self.tokenizer.pad_token_id, start_id,
                                     prefix_reuse, {key: spec.plugin for key, spec in self.head_specs.items()})
        if self.updater is not None and not any(p.requires_grad for p in self.module.parameters()):
            raise PluginError(f"LLM {self.llm.name!r} has an updater but no trainable parameter "
                              "(did an initializer freeze everything?)")

    def build_engine(self) -> dict:
        """Wrap the module in a DeepSpeed engine (collective: every rank of the LLM calls it)."""
        import deepspeed

        optimizer = None
        if self.updater is not None:
            optimizer = make_optimizer([p for p in self.module.parameters() if p.requires_grad],
                                       self.llm.training.optimizer)
        else:
            self.module.requires_grad_(False)
        ds_config = dict(self.ds_config)
        if optimizer is None and self.llm.training.zero_stage in (1, 2):
            ds_config["zero_optimization"] = {**ds_config["zero_optimization"], "stage": 0}
        self.engine, *_ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=ds_config,
                                               dist_init_required=False)
        self.engine.eval()
        if self.llm.checkpoint:
            from llmrl.engine.checkpoint import load_checkpoint

            load_checkpoint(self, self.llm.checkpoint)
        return self.describe()

    def describe(self) -> dict:
        params = list(self.module.parameters())
        return {
            "llm": self.llm.name,
            "kind": self.llm.type,
            "heads": {k: type(h).level for k, h in self.module.heads.items()},
            "adapters": self.adapters,
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "max_length": self.max_length,
            "device": str(self.device),
            "dtype": self.llm.dtype,
            "updater": type(self.updater).__name__ if self.updater else None,
        }

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    # ------------------------------------------------------------------ requests

    def check_heads(self, keys) -> tuple:
        keys = tuple(keys or ())
        unknown = [k for k in keys if k not in self.module.heads]
        if unknown:
            available = ", ".join(sorted(self.module.heads)) or "none configured"
            raise ValueError(f"unknown head(s) {unknown} for LLM {self.llm.name!r}; available: {available} "
                             f"(llms.{self.llm.name}.heads)")
        return keys

    def needs_for(self, keys) -> Needs:
        heads = [self.module.heads[k] for k in keys]
        return Needs(context_hidden=any(h.needs_context_hidden for h in heads),
                     candidate_hidden=any(h.needs_candidate_hidden for h in heads))

    @contextlib.contextmanager
    def adapter(self, name: str | None):
        """Run with the named LoRA adapter active (requires_grad flags are left as they were)."""
        if name is None:
            yield
            return
        if name not in self.adapters:
            raise ValueError(f"unknown peft_adapter {name!r} for LLM {self.llm.name!r}; adapters: "
                             f"{', '.join(self.adapters) or 'none (configure the lora initializer)'}")
        peft_model = self.model
        previous = peft_model.active_adapter
        flags = [(p, p.requires_grad) for p in peft_model.parameters()]
        peft_model.set_adapter(name)
        for p, flag in flags:
            p.requires_grad_(flag)
        try:
            yield
        finally:
            peft_model.set_adapter(previous)
            for p, flag in flags:
                p.requires_grad_(flag)

    def plan(self, contexts, candidates, keys, minibatch_size=None):
        needs = self.needs_for(keys)
        plan = tokenize(self.tokenizer, self.llm.type, contexts, candidates, max_length=self.max_length,
                        prefix_reuse=self.module.prefix_reuse)
        batches = plan_batches(plan, self.llm.token_budget, minibatch_size or self.llm.minibatch_size, needs)
        return plan, batches, needs

    def forward(self, plan, batches, needs, keys):
        """One engine call over planned batches (lockstep-padded under ZeRO-3 with replicas)."""
        extra = 0
        if self.lockstep:
            calls = count_model_calls(plan, batches, self.llm.type)
            from llmrl.engine.group_sync import max_int

            extra = max_int(calls, self.control_group) - calls
        return self.engine(plan=plan, batches=batches, needs=needs, head_keys=keys, extra_calls=extra)

    def score(self, payload: dict):
        contexts = payload["contexts"]
        candidates = payload.get("candidates")
        keys = self.check_heads(payload.get("heads"))
        with torch.no_grad(), self.adapter(payload.get("peft_adapter")):
            plan, batches, needs = self.plan(contexts, candidates, keys, payload.get("minibatch_size"))
            out = self.forward(plan, batches, needs, keys)
        if not self.role.is_replica_leader:
            return None
        return split_by_context(plan, out, keys, {k: type(self.module.heads[k]).level for k in keys})

    def generate(self, payload: dict):
        from llmrl.engine.generation import generate

        contexts = payload["contexts"]
        kwargs = dict(payload.get("kwargs") or {})
        extra = 0
        with torch.no_grad(), self.adapter(payload.get("peft_adapter")):
            if self.lockstep:
                from llmrl.engine.generation import plan_generation
                from llmrl.engine.group_sync import max_int

                lengths = [len(ids) for ids in self.tokenizer(contexts)["input_ids"]] if contexts else []
                new = int(kwargs.get("max_new_tokens", 20))
                count = len(plan_generation(lengths, new, int(kwargs.get("num_return_sequences", 1)),
                                            self.llm.token_budget, self.llm.minibatch_size))
                extra = max_int(count, self.control_group) - count
            results = generate(self.engine.module.model, self.tokenizer, self.llm.type, contexts, kwargs, self.device,
                               self.llm.token_budget, payload.get("minibatch_size") or self.llm.minibatch_size,
                               self.max_length, synced=self.lockstep, seed=payload.get("seed"), extra_batches=extra)
        return results if self.role.is_replica_leader else None

    def update(self, payload: dict):
        from llmrl.engine.training import run_update

        stats = run_update(self, payload)
        return stats if self.role.is_replica_leader else None

    def save(self, payload: dict):
        from llmrl.engine.checkpoint import save_shard

        return save_shard(self, payload["path"])

    def state_dict(self, payload: dict):
        from llmrl.engine.checkpoint import state_dict_request

        return state_dict_request(self, payload)

    def memory(self) -> dict:
        import resource

        import psutil

        info = psutil.Process().memory_info()
        out = {"rss": info.rss, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
            out["cuda_peak"] = torch.cuda.max_memory_allocated(self.device)
        if self.module is not None:
            out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in self.module.parameters())
        elif self.model is not None:
            out["parameter_bytes"] = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return out

    def sleep(self, payload: dict):
        time.sleep(float(payload.get("seconds", 0)))
        return payload.get("echo")


def _plugin_error(message: str, plugin: str) -> PluginError:
    error = PluginError(message)
    error.plugin = plugin
    return error


def split_by_context(plan: TokenPlan, out: dict, keys, levels: dict) -> list[dict]:
    """Per-context results: scores, token counts and head outputs as CPU tensors."""
    scores = out["scores"].detach().float().cpu()
    counts = out["counts"].cpu()
    heads = {k: out[f"head:{k}"].detach().cpu() for k in keys}
    results, start = [], 0
    for i, ctx in enumerate(plan.contexts):
        k = len(ctx.candidates)
        entry = {"scores": scores[start:start + k].clone(), "counts": counts[start:start + k].clone(), "heads": {}}
        for key, value in heads.items():
            entry["heads"][key] = value[i].clone() if levels[key] == "context" else value[start:start + k].clone()
        results.append(entry)
        start += k
    return results


def make_optimizer(params, spec):
    if spec.type == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.type == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
