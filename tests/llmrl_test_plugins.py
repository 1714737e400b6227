"""Plugins used by the tests; servers import them as ``llmrl_test_plugins:Name`` (tests/ is on their path)."""

from __future__ import annotations

import os
import time

import torch

from llmrl.plugins.contracts import Head, Initializer, Updater


class ChosenScoreUpdater(Updater):
    """loss_i = -weight_i * log p(chosen candidate_i | context_i) [+ (V(context_i) - target_i)^2].

    Deterministic and simple, so that a plain PyTorch step can reproduce it exactly.
    Keyword arguments of ``update``: actions, weights, targets (per sample); adapter, fail_on_replica,
    fail_after_steps and fail_by_exit (whole: make one replica raise, or call sys.exit, after that many
    micro-steps).

    Token level instead, when ``token_weights`` is given (per sample, one weight per token of the chosen
    candidate): loss_i = -sum_t token_weights_i[t] * log p(token t) - entropy_coef * sum_t H_t, read from
    ``trainer.forward(..., per_token=True, entropy=True)`` (the head is not used).
    """

    def __init__(self, head: str | None = None):
        self.head = head

    def update(self, batch, trainer):
        total, steps = 0.0, 0
        adapter = batch.kwargs.get("adapter")
        fail_on = batch.kwargs.get("fail_on_replica")
        for mb in batch.minibatches(trainer.micro_batch_size):
            if fail_on == batch.replica and steps >= batch.kwargs.get("fail_after_steps", 0):
                if batch.kwargs.get("fail_by_exit"):
                    raise SystemExit(f"deliberate exit on replica {batch.replica}")
                raise ValueError(f"deliberate failure on replica {batch.replica}")
            if "token_weights" in mb.kwargs:
                loss = mb.mean(self.token_level(trainer, mb))
                trainer.backward(loss)
                trainer.step()
                total += float(loss)
                steps += 1
                continue
            out = trainer.forward(mb.contexts, mb.candidates, heads=[self.head] if self.head else [],
                                  peft_adapter=adapter)
            scores, _ = out.scores_by_context(fill=0.0)
            actions = torch.as_tensor(mb.kwargs["actions"], dtype=torch.long, device=scores.device)
            weights = torch.as_tensor(mb.kwargs["weights"], dtype=torch.float32, device=scores.device)
            per_sample = -weights * scores.gather(1, actions[:, None]).squeeze(1)
            if self.head:
                targets = torch.as_tensor(mb.kwargs["targets"], dtype=torch.float32, device=scores.device)
                per_sample = per_sample + (out.heads[self.head] - targets) ** 2
            loss = mb.mean(per_sample)
            trainer.backward(loss)
            trainer.step()
            total += float(loss)
            steps += 1
        stats = {"loss": total, "micro_steps": steps, "replica": batch.replica, "indices": batch.indices}
        if batch.kwargs.get("undecodable_stat"):
            stats["odd"] = ServerOnly()
        return stats

    @staticmethod
    def token_level(trainer, mb) -> torch.Tensor:
        out = trainer.forward(mb.contexts, mb.candidates, per_token=True, entropy=True)
        logp, mask = out.tokens_by_candidate()
        entropy, _ = out.tokens_by_candidate(out.token_entropy)
        per_context = torch.bincount(out.candidate_context.cpu(), minlength=out.num_contexts)
        first = torch.cumsum(per_context, 0) - per_context
        rows = (first + torch.as_tensor(mb.kwargs["actions"], dtype=torch.long)).to(logp.device)
        weights = torch.zeros(len(rows), logp.shape[1], device=logp.device)
        for i, w in enumerate(mb.kwargs["token_weights"]):
            assert len(w) == int(mask[rows[i]].sum()), "one weight per scored token of the chosen candidate"
            weights[i, : len(w)] = torch.as_tensor(w, dtype=torch.float32)
        coef = float(mb.kwargs.get("entropy_coef", 0.0))
        return -(weights * logp[rows]).sum(1) - coef * (entropy[rows] * mask[rows]).sum(1)


def _refuse_to_rebuild():
    raise RuntimeError("this object cannot be rebuilt here")


class ServerOnly:
    """Pickles fine and cannot be unpickled (stands for a class the client cannot import)."""

    def __reduce__(self):
        return _refuse_to_rebuild, ()


class ConstantHead(Head):
    """Outputs ``value`` for every context (plus 0 x a parameter, so it is a real module)."""

    args_schema = {"type": "object", "properties": {"value": {"type": "number"}}, "additionalProperties": False}

    def __init__(self, llm, value: float = 1.5):
        super().__init__(llm)
        self.value = value
        self.scale = torch.nn.Parameter(torch.zeros(1))

    def forward(self, outputs):
        return torch.full((outputs.num_contexts,), self.value) + 0 * self.scale


class CandidateLengthHead(Head):
    """A candidate-level head: the number of tokens of each candidate (checks boundaries reach heads)."""

    level = "candidate"
    needs_context_hidden = False
    needs_candidate_hidden = True

    def forward(self, outputs):
        return outputs.candidate_token_counts.float() + 0 * outputs.candidate_hidden.sum(-1)


class ContextLayersHead(Head):
    """Context level, layers 0, 1 and the last: returns them untouched in a dict; the per-context keyword argument
    ``scale`` (one number per context) multiplies layer 1 (checks kwargs are sliced with the contexts)."""

    level = "context"
    hidden_layers = (0, 1, -1)

    def forward(self, outputs, scale=None):
        layers = outputs.context_hidden_layers
        scaled = layers[1] if scale is None else layers[1] * torch.as_tensor(scale, dtype=layers[1].dtype)[:, None]
        return {"h0": layers[0], "scaled_h1": scaled, "last": outputs.context_hidden}


class CandidateLayersHead(Head):
    """Candidate level, the embeddings' and the second-to-last entries of hidden_states, untouched."""

    level = "candidate"
    needs_context_hidden = False
    needs_candidate_hidden = True
    hidden_layers = (0, -2)

    def forward(self, outputs, **kwargs):
        return {"h0": outputs.candidate_hidden_layers[0], "h_2": outputs.candidate_hidden_layers[-2]}


class TokenProbeHead(Head):
    """Token level: per scored token, the hidden states (layer 1 and last) at the position predicting it, its
    logits, and the call's ``offset`` keyword argument added to its log-prob."""

    level = "token"
    needs_context_hidden = False
    needs_token_hidden = True
    needs_logits = True
    hidden_layers = (1,)

    def forward(self, outputs, **kwargs):
        return {"h1": outputs.token_hidden_layers[1], "last": outputs.token_hidden, "logits": outputs.token_logits,
                "logprob": outputs.token_logprobs + kwargs.get("offset", 0.0)}


class PolicyEntropyHead(Head):
    """Context level, reading a context's candidates together: the entropy of the softmax policy over them."""

    level = "context"
    needs_context_hidden = False

    def forward(self, outputs):
        scores, mask = outputs.scores_by_context()
        logp = torch.log_softmax(scores, -1).masked_fill(~mask, 0)
        return -(logp.exp() * logp).sum(-1)


class CandidateBonusHead(Head):
    """Candidate level: each candidate's log pi (the log-softmax over the candidates its context has here) and the
    entry of ``bonus`` at its position (one list of values per context, one per candidate), as ``[log_pi, bonus]``
    rows."""

    level = "candidate"
    needs_context_hidden = False

    def forward(self, outputs, bonus=None):
        scores, mask = outputs.scores_by_context()
        log_pi = torch.log_softmax(scores, -1)[mask]
        counts = mask.sum(-1).tolist()
        given = torch.tensor([float(bonus[c][j]) for c in range(outputs.num_contexts) for j in range(counts[c])],
                             dtype=log_pi.dtype)
        return torch.stack([log_pi, given], -1)


class BadRowsHead(Head):
    """Returns a dict whose entry 'bad' has one row per context although the head is candidate-level."""

    level = "candidate"

    def forward(self, outputs):
        return {"bad": outputs.context_hidden[:, :1]}


class SlowHead(Head):
    """Sleeps ``seconds`` in its forward: a request that takes too long. With ``mark``, first creates the file
    ``<mark>.<pid>`` (so a test can see that the request is in flight)."""

    def __init__(self, llm, seconds: float = 5.0, mark: str | None = None):
        super().__init__(llm)
        self.seconds = seconds
        self.mark = mark

    def forward(self, outputs):
        if self.mark:
            open(f"{self.mark}.{os.getpid()}", "w").close()
        time.sleep(self.seconds)
        return torch.zeros(outputs.num_contexts)


class GateHead(Head):
    """Keeps its rank busy in its forward while the test holds the file ``path`` locked (``fcntl.flock``, exclusive):
    it waits for a shared lock on it, which the kernel grants the moment the test lets go (or its process ends). A
    test that never lets go fails after ``timeout`` seconds (the wait's bound, not a measure of speed) instead of
    holding the rank."""

    def __init__(self, llm, path: str, timeout: float = 120.0):
        super().__init__(llm)
        self.path = path
        self.timeout = timeout

    def forward(self, outputs):
        import fcntl
        import threading

        with open(self.path) as gate:
            waiting = threading.Thread(target=fcntl.flock, args=(gate.fileno(), fcntl.LOCK_SH), daemon=True)
            waiting.start()
            waiting.join(self.timeout)
            if waiting.is_alive():
                raise TimeoutError(f"the gate {self.path} stayed locked for {self.timeout:g} s")
        return torch.zeros(outputs.num_contexts)


class BrokenHead(Head):
    """Raises in its forward."""

    def forward(self, outputs):
        raise RuntimeError("BrokenHead always fails")


class ExitingHead(Head):
    """Calls sys.exit in its forward."""

    def forward(self, outputs):
        raise SystemExit(3)


class NoForwardHead(torch.nn.Module):
    """Breaks the head contract (no forward(outputs))."""

    def __init__(self, llm):
        super().__init__()


class NotAModelInitializer(Initializer):
    """Returns the model's class name instead of the model (a plugin bug the server must name)."""

    def initialize(self, model, llm):
        return type(model).__name__


class SlowSaves(Initializer):
    """Test hook, applied by monkeypatching on the server: every checkpoint save after the first ``fast_saves``
    sleeps ``seconds`` after writing DeepSpeed's part (so that a test can kill the run in the middle of a save).
    Leaves the model untouched."""

    def __init__(self, seconds: float = 60.0, fast_saves: int = 0):
        self.seconds = seconds
        self.fast_saves = fast_saves

    def initialize(self, model, llm):
        from llmrl.engine.model import checkpoint

        original = checkpoint.save_rank_state
        seconds, saves = self.seconds, [0]

        def slow_save_rank_state(*args, **kwargs):
            saves[0] += 1
            if saves[0] > self.fast_saves:
                time.sleep(seconds)
            return original(*args, **kwargs)

        checkpoint.save_rank_state = slow_save_rank_state
        return model


class MisbehavingUpdater(Updater):
    """The ways a ported updater goes wrong, picked by the ``mode`` keyword of ``update`` (for the guards'
    tests); any other mode trains like ChosenScoreUpdater without a head.

    - ``per_sample``: Lamorel's loop, one forward / backward / step per local sample;
    - ``direct_backward``: ``loss.backward()`` instead of ``trainer.backward(loss)``;
    - ``categorical``: ``Categorical(logits=scores)`` on every minibatch of one sample, empty ones included;
    - ``nan_gradient``: on replica ``bad_replica``, a finite loss (0) whose gradient is infinite (sqrt at 0);
    - ``no_step``: ``trainer.backward`` without ``trainer.step()`` after it;
    - ``fail_before_step``: replica ``bad_replica`` raises between its backward and its step.
    """

    def update(self, batch, trainer):
        mode = batch.kwargs.get("mode")
        if mode == "per_sample":
            for i in range(len(batch)):
                trainer.backward(batch.mean(self.losses(trainer, batch.select([i], [1] * batch.num_replicas))))
                trainer.step()
            return {}
        for mb in batch.minibatches(1 if mode == "categorical" else trainer.micro_batch_size):
            if mode == "categorical":
                out = trainer.forward(mb.contexts, mb.candidates)
                scores, _ = out.scores_by_context()
                actions = torch.as_tensor(mb.kwargs["actions"], dtype=torch.long)
                loss = mb.mean(-torch.distributions.Categorical(logits=scores).log_prob(actions))
            else:
                per_sample = self.losses(trainer, mb)
                if mode == "nan_gradient" and batch.replica == batch.kwargs["bad_replica"]:
                    per_sample = per_sample + torch.sqrt(per_sample - per_sample.detach())  # 0, d/dx = inf
                loss = mb.mean(per_sample)
            if mode == "direct_backward":
                loss.backward()
            else:
                trainer.backward(loss)
            if mode == "fail_before_step" and batch.replica == batch.kwargs["bad_replica"]:
                raise RuntimeError("this replica failed between its backward and its step")
            if mode != "no_step":
                trainer.step()
        return {}

    @staticmethod
    def losses(trainer, mb) -> torch.Tensor:
        out = trainer.forward(mb.contexts, mb.candidates)
        scores, _ = out.scores_by_context(fill=0.0)
        actions = torch.as_tensor(mb.kwargs["actions"], dtype=torch.long, device=scores.device)
        weights = torch.as_tensor(mb.kwargs["weights"], dtype=torch.float32, device=scores.device)
        return -weights * scores.gather(1, actions[:, None]).squeeze(1)


class PolicyThenBaseValueUpdater(Updater):
    """Two training forwards before one backward per minibatch: the policy's (LoRA on) scores of every candidate, and
    the ``value`` head on the base model (``trainer.adapters_disabled()``) at every token; loss = -mean(weights x
    candidate scores) + mean((value - 1)^2). Per-sample keyword argument: ``weights`` (one per candidate)."""

    def update(self, batch, trainer):
        for mb in batch.minibatches(trainer.micro_batch_size):
            out = trainer.forward(mb.contexts, mb.candidates)
            with trainer.adapters_disabled():
                base = trainer.forward(mb.contexts, mb.candidates, heads=["value"], per_token=True)
            weights = torch.tensor([w for ws in mb.kwargs["weights"] for w in ws], dtype=torch.float32)
            per_candidate = -weights.to(out.candidate_scores.device) * out.candidate_scores
            values, mask = base.tokens_by_candidate(base.heads["value"].float())
            value_loss = (((values - 1.0) ** 2) * mask).sum(1)
            per_sample = torch.zeros(base.num_contexts).index_add(0, base.candidate_context.cpu(),
                                                                  (per_candidate + value_loss).cpu())
            trainer.backward(mb.mean(per_sample))
            trainer.step()
        return {}



class AlternatingAdaptersUpdater(Updater):
    """Minibatch k trains LoRA adapter ``adapters[k % 2]``: with ``gradient_accumulation_steps: 2`` each optimizer
    step trains adapter a in its first micro-step and adapter b in its second. loss = -mean(weights x candidate
    scores); per-sample keyword argument ``weights`` (one per candidate)."""

    def __init__(self, adapters=("a", "b")):
        self.adapters = list(adapters)

    def update(self, batch, trainer):
        for k, mb in enumerate(batch.minibatches(trainer.micro_batch_size)):
            out = trainer.forward(mb.contexts, mb.candidates, peft_adapter=self.adapters[k % 2])
            weights = torch.tensor([w for ws in mb.kwargs["weights"] for w in ws], dtype=torch.float32)
            per_candidate = -weights.to(out.candidate_scores.device) * out.candidate_scores
            per_sample = torch.zeros(out.num_contexts).index_add(0, out.candidate_context.cpu(), per_candidate.cpu())
            trainer.backward(mb.mean(per_sample))
            trainer.step()
        return {}
