"""Training steps written in the script (``forward_backward`` / ``forward`` / ``forward_backward_custom`` /
``optim_step``) equal the same steps on a plain PEFT model with plain torch AdamW, to 1e-5, for 1 and 2 replicas and
ZeRO 0-3 (ZeRO-1 with backward passes bounded by tokens), and for 2 replicas of 2 tensor-parallel ranks each at ZeRO-2
(the adapter whole on each rank, applied in parts over the split layers: :mod:`llmrl.engine.model.tp_lora`).

The reference computes every loss by hand from its definition (Tinker's), sums it over all target tokens of all
datums, back-propagates, clips with ``torch.nn.utils.clip_grad_norm_`` and steps ``torch.optim.AdamW`` with the
hyperparameters of that step. It checks the returned per-token log-probs, loss sums and gradient norms too, that
gradients of three calls accumulate to those of one call over their union, that a DPO loss run on the client equals
autograd through the plain model, and that bad data and misuse are refused with the field at fault while the servers
go on; and that an adapter state damaged or crafted on disk is refused naming the field, changing nothing.
"""

from __future__ import annotations

import pytest
import torch

from llmrl import completion_datum
from testkit import LiveRun, assert_same_training

pytestmark = pytest.mark.slow

LAYOUTS = {"r1z0": (1, 0, 1), "r2z0": (2, 0, 1), "r1z1": (1, 1, 1), "r2z2": (2, 2, 1), "r2z3": (2, 3, 1),
           "r2tp2z2": (2, 2, 2)}  # (replicas, ZeRO stage, tensor-parallel ranks)
LORA = {"plugin": "lora", "args": {"adapters": {"default": {"r": 4}}}}


@pytest.fixture(scope="module")
def run(tiny):
    llms = {name: {"model": tiny["llama"], "replicas": replicas, "initializers": [LORA], "trainable": True,
                   "tensor_parallel": tp, "training": {"zero_stage": zero, "optimizer": {"type": "adamw", "lr": 1e-3}}}
            for name, (replicas, zero, tp) in LAYOUTS.items()}
    llms["r1z1"]["training"]["max_tokens_per_micro_batch"] = 16  # a call's 23 tokens go back in passes
    llms["frozen"] = {"model": tiny["llama"]}
    live = LiveRun({"llms": llms, "threads_per_rank": 1})
    yield live
    assert live.close() == 0


@pytest.fixture(scope="module")
def plain(run, tiny):
    """The reference, stepped along with every layout by every test (Adam's moments carry over)."""
    return Plain(tiny, run.state_dict(llm="r1z0"))


class Plain:
    """The plain reference: a PEFT model holding the run's starting weights, and torch AdamW."""

    def __init__(self, tiny, start: dict):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
        self.model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                     target_modules="all-linear"))
        self.params = {f"model.{k}": p for k, p in self.model.named_parameters() if ".lora_" in k}
        with torch.no_grad():
            for key, p in self.params.items():
                p.copy_(start[key])
                p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-3)

    def logprobs(self, datum: dict) -> torch.Tensor:
        ids = torch.tensor([datum["model_input"]])
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), -1)
        return logp.gather(1, torch.tensor(datum["loss_fn_inputs"]["target_tokens"])[:, None])[:, 0]

    def step(self, loss: torch.Tensor, lr: float, clip: float = 0.0, weight_decay: float = 0.0) -> float:
        """One AdamW step; the gradient's norm before clipping."""
        self.optimizer.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), clip or float("inf")))
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = lr, weight_decay
        self.optimizer.step()
        return norm

    def weights(self) -> dict:
        return {k: p.detach().clone() for k, p in self.params.items()}


def make_data(seed: int, lengths=(7, 12, 4)) -> list[dict]:
    """Datums of random tokens whose first half is a prompt (its inputs 0), with random per-token inputs."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(3, 100, (n,), generator=g).tolist()
        prompt = n // 2
        mask = torch.tensor([0.0] * (prompt - 1) + [1.0] * (n - prompt))
        data.append({"model_input": tokens[:-1], "loss_fn_inputs": {
            "target_tokens": tokens[1:],
            "weights": (mask * torch.rand(n - 1, generator=g)).tolist(),
            "advantages": (mask * torch.randn(n - 1, generator=g)).tolist(),
            "logprobs": (mask * -(torch.rand(n - 1, generator=g) * 4 + 3)).tolist(),
            "sequence_ratio_mask": mask.tolist()}})
    return data


def inputs_for(loss_fn: str, datum: dict) -> dict:
    needs = {"cross_entropy": ("weights",), "gspo": ("logprobs", "advantages", "sequence_ratio_mask")}.get(
        loss_fn, ("logprobs", "advantages"))
    inputs = datum["loss_fn_inputs"]
    return {"model_input": datum["model_input"],
            "loss_fn_inputs": {"target_tokens": inputs["target_tokens"], **{k: inputs[k] for k in needs}}}


def hand_loss(loss_fn: str, logp: torch.Tensor, datum: dict, config: dict) -> torch.Tensor:
    """Per-token losses from their definitions."""
    inputs = {k: torch.tensor(v) for k, v in datum["loss_fn_inputs"].items() if k != "target_tokens"}
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * logp
    adv, old = inputs["advantages"], inputs["logprobs"]
    ratio = torch.exp(logp - old)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    if loss_fn == "cispo":
        return -ratio.detach().clamp(config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)) \
            * adv * logp
    if loss_fn == "gspo":  # GSPO-token: the sequence's geometric-mean ratio, each token's own gradient
        marked = inputs["sequence_ratio_mask"] > 0
        sequence = torch.exp((logp - old)[marked].mean()).detach()
        prob = torch.exp(logp)
        token_ratio = sequence * prob / prob.detach()
        return -torch.minimum(token_ratio * adv, token_ratio.clamp(0.8, 1.2) * adv)
    return -(logp * adv - config["beta"] / 2 * (logp - old) ** 2)


STEPS = [("cross_entropy", {}, {"learning_rate": 3e-3}),
         ("importance_sampling", {}, {"learning_rate": 2.5e-3, "weight_decay": 0.1}),
         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"learning_rate": 2e-3,
                                                                            "grad_clip_norm": 0.05}),
         ("cispo", {}, {"learning_rate": 2e-3}),
         ("dro", {"beta": 0.5}, {"learning_rate": 1.5e-3}),
         ("gspo", {}, {"learning_rate": 2e-3})]


def test_each_built_in_loss_then_optim_step_equals_plain_peft_and_adamw(run, plain):
    start = run.state_dict(llm="r1z0")
    for k, (loss_fn, config, adam) in enumerate(STEPS):
        data = [inputs_for(loss_fn, d) for d in make_data(k)]
        # the sampler's log-probs near the model's, so that ratios fall inside and outside the clip range (drawn from
        # a generator of this step's own: the global one's state depends on the tests that ran before in the process)
        noise = torch.Generator().manual_seed(100 + k)
        for datum in data:
            if "logprobs" in datum["loss_fn_inputs"]:
                with torch.no_grad():
                    near = plain.logprobs(datum) + 0.3 * torch.randn(len(datum["model_input"]), generator=noise)
                datum["loss_fn_inputs"]["logprobs"] = near.tolist()
        want_logp = [plain.logprobs(d) for d in data]
        losses = [hand_loss(loss_fn, lp, d, config) for lp, d in zip(want_logp, data)]
        want_loss = sum(loss.sum() for loss in losses)
        norms = {}
        for name in LAYOUTS:
            out = run.forward_backward(data, loss_fn, config, llm=name)
            for got, want in zip(out["loss_fn_outputs"], want_logp):
                torch.testing.assert_close(got["logprobs"], want.detach(), atol=1e-5, rtol=1e-5)
            for got, want in zip(out["loss_fn_outputs"], losses):
                torch.testing.assert_close(got["elementwise_loss"], want.detach(), atol=1e-5, rtol=1e-5)
            assert out["metrics"]["loss:sum"] == pytest.approx(float(want_loss.detach()), abs=1e-4)
            stepped = run.optim_step(adam, llm=name)
            assert stepped["optimizer_steps"] == 1 and stepped["adapters"] == ["default"]
            norms[name] = stepped["grad_norm"]
        norm = plain.step(want_loss, adam["learning_rate"], adam.get("grad_clip_norm", 0.0),
                          adam.get("weight_decay", 0.0))
        assert norms == pytest.approx({name: norm for name in LAYOUTS}, rel=1e-4), loss_fn  # before clipping
    want = plain.weights()
    for name in LAYOUTS:
        assert_same_training(run.state_dict(llm=name), want, start, atol=1e-5, min_moved=len(want) // 2,
                             label=f"{name} ")


def test_three_accumulated_calls_equal_one_call_over_their_union(run, plain):
    start = run.state_dict(llm="r1z0")
    data = [inputs_for("importance_sampling", d) for d in make_data(10, lengths=(9, 5, 14))]
    for name in LAYOUTS:
        for datum in data:  # one datum per call: a replica of two gets nothing, and still takes part
            run.forward_backward([datum], "importance_sampling", llm=name)
        run.optim_step({"learning_rate": 3e-3}, llm=name)
    loss = sum(hand_loss("importance_sampling", plain.logprobs(d), d, {}).sum() for d in data)
    plain.step(loss, 3e-3)
    want = plain.weights()
    for name in LAYOUTS:
        assert_same_training(run.state_dict(llm=name), want, start, atol=1e-5, min_moved=len(want) // 2,
                             label=f"{name} ")


def dpo_loss(data, logprobs):
    """DPO on (chosen, rejected) pairs: data[2i] is chosen, data[2i+1] rejected, reference log-probs in the
    datums' ``ref`` input (only completion tokens count: their ``mask``)."""
    beta, losses = 0.5, []
    for i in range(0, len(data), 2):
        margin = 0.0
        for sign, k in ((1.0, i), (-1.0, i + 1)):
            inputs = data[k]["loss_fn_inputs"]
            mask, ref = torch.tensor(inputs["mask"]), torch.tensor(inputs["ref"])
            margin = margin + sign * ((logprobs[k] - ref) * mask).sum()
        losses.append(-torch.nn.functional.logsigmoid(beta * margin))
    loss = torch.stack(losses).mean()
    return loss, {"dpo_loss": float(loss.detach())}


def test_a_dpo_loss_written_in_the_script_equals_autograd_through_the_plain_model(run, plain):
    start = run.state_dict(llm="r1z0")
    data = make_data(20, lengths=(8, 10, 6, 9))
    with torch.no_grad():
        for datum in data:
            inputs = datum["loss_fn_inputs"]
            inputs["mask"] = [float(w > 0) for w in inputs["weights"]]
            inputs["ref"] = (plain.logprobs(datum) - 0.1).tolist()
    for name in LAYOUTS:
        out = run.forward_backward_custom(data, dpo_loss, llm=name)
        run.optim_step({"learning_rate": 3e-3}, llm=name)
    loss, metrics = dpo_loss(data, [plain.logprobs(d) for d in data])
    assert out["metrics"]["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    assert out["metrics"]["dpo_loss"] == pytest.approx(metrics["dpo_loss"], abs=1e-5)
    plain.step(loss, 3e-3)
    want = plain.weights()
    for name in LAYOUTS:
        assert_same_training(run.state_dict(llm=name), want, start, atol=1e-5, min_moved=len(want) // 2,
                             label=f"{name} ")


def test_forward_returns_the_log_probs_without_touching_pending_gradients(run, plain):
    start = run.state_dict(llm="r1z0")
    data = [inputs_for("cross_entropy", d) for d in make_data(30)]
    want_logp = [plain.logprobs(d).detach() for d in data]
    for name in LAYOUTS:
        run.forward_backward(data, "cross_entropy", llm=name)
        out = run.forward(data, llm=name)  # no loss: log-probs only, with the weights not yet stepped
        for got, want in zip(out["loss_fn_outputs"], want_logp):
            torch.testing.assert_close(got["logprobs"], want, atol=1e-5, rtol=1e-5)
        assert out["metrics"] == {}
        run.optim_step({"learning_rate": 2e-3}, llm=name)
    plain.step(sum(hand_loss("cross_entropy", plain.logprobs(d), d, {}).sum() for d in data), 2e-3)
    for name in LAYOUTS:
        assert_same_training(run.state_dict(llm=name), plain.weights(), start, atol=1e-5, min_moved=4,
                             label=f"{name} ")


def test_the_cookbooks_rl_loop_datums_train_as_the_shifted_ones_do(run):
    """rl_loop's datums hold target 0 at the prompt's positions, with advantage 0 there: the same losses (and so the
    same gradients) as the datums shifted by one, and NaN log-probs where the forward read no target."""
    prompt, sampled = [5, 17, 33, 8], [40, 41, 42]
    ob = len(prompt) - 1
    logprobs, advantage = [-1.0, -2.0, -0.5], 0.7
    rl_loop = [{"model_input": prompt + sampled[:-1], "loss_fn_inputs": {
        "target_tokens": [0] * ob + sampled, "logprobs": [0.0] * ob + logprobs,
        "advantages": [0.0] * ob + [advantage] * len(sampled)}}]
    shifted = [completion_datum(prompt, sampled, logprobs=logprobs, advantages=advantage)]
    got, want = (run.forward(data, "importance_sampling", llm="r2z0") for data in (rl_loop, shifted))
    assert got["metrics"]["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], abs=1e-6)
    (ours,), (theirs,) = got["loss_fn_outputs"], want["loss_fn_outputs"]
    assert torch.isnan(ours["logprobs"][:ob]).all() and torch.equal(ours["logprobs"][ob:], theirs["logprobs"][ob:])
    torch.testing.assert_close(ours["elementwise_loss"], theirs["elementwise_loss"], atol=0, rtol=0)


def bad_metrics_loss(data, logprobs):
    return sum(lp.sum() for lp in logprobs), {"note": "not a number"}


def test_bad_data_and_misuse_are_refused_naming_the_field_and_the_servers_go_on(run):  # last: r2z2 diverges
    from llmrl import InvalidArgument

    good = [inputs_for("importance_sampling", d) for d in make_data(40)]
    short = [dict(good[0]), good[1]]
    short[0] = {"model_input": good[0]["model_input"],
                "loss_fn_inputs": {**good[0]["loss_fn_inputs"], "advantages": [1.0, 2.0]}}
    with pytest.raises(InvalidArgument, match=r"data\[0\]\['loss_fn_inputs'\]\['advantages'\] has 2 values"):
        run.forward_backward(short, "importance_sampling", llm="r2z2")
    unshifted = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [6, 9, 8], "weights": [1, 1, 1]}}
    with pytest.raises(InvalidArgument, match=r"target_tokens'\]\[1\] is 9 but the next input token is 7"):
        run.forward_backward([unshifted], "cross_entropy", llm="r2z2")
    nan = {"model_input": [5, 6], "loss_fn_inputs": {"target_tokens": [6, 7], "weights": [1.0, float("nan")]}}
    with pytest.raises(InvalidArgument, match=r"\['weights'\]\[1\] is nan"):
        run.forward_backward([nan], "cross_entropy", llm="r2z2")
    with pytest.raises(InvalidArgument, match="needs loss_fn_config\\['beta'\\]"):
        run.forward_backward(good, "dro", llm="r2z2")
    with pytest.raises(InvalidArgument, match="unknown loss_fn 'grpo'"):
        run.forward_backward(good, "grpo", llm="r2z2")
    with pytest.raises(InvalidArgument, match="forward_backward needs a loss_fn"):
        run.forward_backward(good, None, llm="r2z2")
    long = {"model_input": [5] * 600, "loss_fn_inputs": {"target_tokens": [5] * 600, "weights": [1.0] * 600}}
    with pytest.raises(InvalidArgument, match=r"data\[0\] has 600 input tokens; this model accepts at most"):
        run.forward_backward([long], "cross_entropy", llm="r2z2")
    with pytest.raises(InvalidArgument, match="metrics must be a dict of numbers"):
        run.forward_backward_custom(good, bad_metrics_loss, llm="r2z2")
    with pytest.raises(InvalidArgument, match=r"adam_params\['learning_rate'\] must be >= 0"):
        run.optim_step({"learning_rate": -1.0}, llm="r2z2")
    with pytest.raises(InvalidArgument, match=r"adam_params\['learning_rate'\] x adam_params\['weight_decay'\] is "
                                              r"1e\+40: AdamW multiplies each weight by 1 - learning_rate x"):
        run.optim_step({"learning_rate": 1e20, "weight_decay": 1e20}, llm="r2z2")  # the decay would flip the weights
    with pytest.raises(Exception, match="set llms.frozen.trainable: true"):
        run.forward_backward(good, "importance_sampling", llm="frozen")
    before = run.state_dict(llm="r2z2")
    assert run.optim_step({"learning_rate": 1e-2}, llm="r2z2")["optimizer_steps"] == 0  # nothing pending
    run.forward_backward(good, "importance_sampling", llm="r2z2")
    with pytest.raises(Exception, match="call optim_step\\(\\) before update"):
        run.update(["a"], [[" b"]], llm="r2z2")
    assert run.state_dict(llm="r2z2").keys() == before.keys()
    assert run.optim_step({"learning_rate": 1e-2}, llm="r2z2")["optimizer_steps"] == 1


def crafted(source, folder, change) -> str:
    """A copy of the state saved in ``source`` with ``change(state)`` applied, in ``folder``."""
    state = torch.load(source / "adapter_state.pt", weights_only=True)
    change(state)
    folder.mkdir()
    torch.save(state, folder / "adapter_state.pt")
    return str(folder)


def first_moments(state: dict) -> dict:
    return next(entry for entry in state["optimizer"].values() if entry)


def test_a_damaged_or_crafted_state_is_refused_naming_the_field_and_changes_nothing(run, tmp_path):
    """Moments of another shape or dtype, a step count of -1, a NaN in a weight or a moment: each is refused
    naming the field, into the adapter it came from and into a new name alike, and neither changes. The intact
    state, loaded after, trains on as the original."""
    run.create_adapter("t", rank=2, seed=3, targets=["attention"], llm="r1z0")
    adapter_steps(run, "t", seed=50, steps=2)
    run.save_adapter(tmp_path / "t", llm="r1z0", peft_adapter="t")
    nan = float("nan")
    cases = {
        "shape": (lambda s: first_moments(s).update(exp_avg=torch.zeros(1)), r"\['exp_avg'\] has shape \[1\]"),
        "step": (lambda s: first_moments(s).update(step=torch.tensor(-1.0)), r"\['step'\] must be a whole number"),
        "dtype": (lambda s: first_moments(s).update(exp_avg_sq=first_moments(s)["exp_avg_sq"].bfloat16()),
                  r"\['exp_avg_sq'\] is torch.bfloat16"),
        "moment_nan": (lambda s: first_moments(s)["exp_avg"].fill_(nan), r"\['exp_avg'\] holds a value that is not "
                                                                          r"finite \(nan\)"),
        "weight_nan": (lambda s: next(iter(s["weights"].values())).fill_(nan), r"weights\[.*\] holds a value that "
                                                                                r"is not finite \(nan\)"),
    }
    before = run.state_dict(llm="r1z0")  # every adapter, and the plain reference's "default"
    for label, (change, match) in cases.items():
        path = crafted(tmp_path / "t", tmp_path / label, change)
        for name in ("t", "t_new"):
            with pytest.raises(Exception, match=match):
                run.load_adapter(path, name, llm="r1z0")
    with pytest.raises(Exception, match="holds a value that is not finite"):
        run.load_adapter(tmp_path / "weight_nan", "t", optimizer=False, llm="r1z0")
    after = run.state_dict(llm="r1z0")
    assert after.keys() == before.keys()  # no t_new
    assert all(torch.equal(after[k], before[k]) for k in before)
    run.load_adapter(tmp_path / "t", "t_copy", llm="r1z0")
    for name in ("t", "t_copy"):
        adapter_steps(run, name, seed=60, steps=1)
    state = run.state_dict(llm="r1z0")
    got, want = lora_weights(state, "t_copy"), lora_weights(state, "t")
    assert len(want) > 4 and any(not torch.equal(want[k], v) for k, v in lora_weights(after, "t").items())
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    for name in ("t", "t_copy"):
        run.delete_adapter(name, llm="r1z0")


def adapter_steps(run, adapter: str, seed: int, steps: int) -> None:
    for k in range(steps):
        data = [inputs_for("cross_entropy", d) for d in make_data(seed + k)]
        run.forward_backward(data, "cross_entropy", llm="r1z0", peft_adapter=adapter)
        run.optim_step({"learning_rate": 2e-3}, llm="r1z0", peft_adapter=adapter)


def lora_weights(state: dict, adapter: str) -> dict:
    """One adapter's LoRA weights in a run's state dict, named without the adapter's name."""
    marker = f".{adapter}."
    return {k.replace(marker, "."): v for k, v in state.items() if marker in k and "lora_" in k}
