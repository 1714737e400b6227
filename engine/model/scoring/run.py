"""Run one planned batch of a scoring request through the model: log-probs of candidates, hidden states for heads.

This is the entry point of the scoring core; it picks the path the plan chose:

- causal, unpacked (:mod:`~llmrl.engine.model.scoring.causal`): prefix passes, then candidate passes that attend to
  their cache;
- causal, packed (:mod:`~llmrl.engine.model.scoring.packed`): after the common prefix's pass, one call for every
  context and candidate row under a 4-D attention mask;
- seq2seq (:mod:`~llmrl.engine.model.scoring.seq2seq`): the encoder once, decoder rows per candidate.

Each scored token's log-prob is computed once; candidates' scores are their sums. Logits are computed only at the
positions that are scored (``logits_to_keep``), in float32, and reduced to log-probs without materialising a full
log-softmax. When the request asks for them (``Needs.per_token``), per-token log-probs are kept apart with each
token's id, candidate and position, and (``Needs.entropy``) the entropy of the distribution it was drawn from;
hidden states only when a head asks (``Needs``), for the layers it declares, at the positions it reads; so are the
float32 logits at those positions (``Needs.token_logits``). What is collected is
:mod:`~llmrl.engine.model.scoring.results`' job.

With the cache across calls (``prefix_cache``) prefixes are read from and added to it; with frozen-trunk reuse
(``trunk``) every model call goes through the trunk: scoring records, the updater's passes replay (after an
update, this is where cached prefixes get their top layers recomputed from the trunk). The same code serves
``score`` (no grad) and the updater's forward (with grad). It knows nothing about processes or requests.
"""

from __future__ import annotations

import inspect

from llmrl.engine.model.scoring.causal import run_causal
from llmrl.engine.model.scoring.packed import run_packed
from llmrl.engine.model.scoring.planning import BatchSpec, Needs
from llmrl.engine.model.scoring.results import BatchResult
from llmrl.engine.model.scoring.seq2seq import run_seq2seq
from llmrl.engine.model.scoring.tokenization import TokenPlan


def accepts_logits_to_keep(model) -> bool:
    """Whether the model can compute logits at chosen positions only (PEFT wrappers forward it on)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def run_batch(model, plan: TokenPlan, batch: BatchSpec, needs: Needs, pad_id: int, device,
              keep_logits: bool, decoder_start_id: int | None = None, prefix_cache=None, trunk=None) -> BatchResult:
    """Run one planned batch (exactly ``batch.model_calls`` model calls). ``prefix_cache`` (causal models, no-grad
    scoring only) is a :class:`~llmrl.engine.model.reuse.prefix_cache.CacheUse`: prefixes are read from and added
    to that cache across calls. ``trunk`` (causal models) is a :class:`~llmrl.engine.model.reuse.trunk.Trunk` in
    its recording or replaying mode."""
    if plan.kind == "seq2seq":
        return run_seq2seq(model, plan, batch, needs, pad_id, device, decoder_start_id)
    if prefix_cache is not None and prefix_cache.cache.stale_from is not None and trunk is not None:
        # After an update, cached prefixes keep their bottom layers: their top layers are recomputed from the trunk.
        prefix_cache.cache.refresh(prefix_cache.namespace, [plan.contexts[i].prefix for i in batch.contexts],
                                   lambda paths: trunk.top_layers_kv(model, paths, keep_logits))
    run = run_packed if batch.packed else run_causal
    return run(model, plan, batch, needs, pad_id, device, keep_logits, prefix_cache, trunk)
