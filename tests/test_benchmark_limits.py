"""The benchmark states every compute limit at the best matmul rate of its run (hand-computed values)."""

import torch

from benchmarks import run as bench


def test_a_row_measured_at_a_slow_moment_gets_the_runs_best_rate():
    slow = {"workload": "a", "matmul GFLOP/s (best so far)": 100.0, "compute limit s": 8.0, "llmrl s": 6.0,
            "llmrl / limit": 0.75}
    fast = {"workload": "b", "matmul GFLOP/s (best so far)": 200.0, "compute limit s": 5.0, "llmrl / limit": 1.2}
    other = {"workload": "round trip", "median ms": 0.2}
    bench.rebase_limits([slow, fast, other], best=200e9)
    assert slow["compute limit s"] == 4.0 and slow["llmrl / limit"] == 1.5 and slow["llmrl s"] == 6.0
    assert slow["matmul GFLOP/s (best so far)"] == 200.0
    assert fast == {"workload": "b", "matmul GFLOP/s (best so far)": 200.0, "compute limit s": 5.0,
                    "llmrl / limit": 1.2}
    assert other == {"workload": "round trip", "median ms": 0.2}


class CharTokenizer:
    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


class TwoLayerModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": 4, "num_hidden_layers": 2, "vocab_size": 10})()
        self.embed = torch.nn.Embedding(10, 4)  # not a layer parameter: never counted per token
        self.model = torch.nn.Module()  # parameters named model.layers.N..., as in Hugging Face decoders
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False) for _ in range(2)])


def test_necessary_work_counts_layers_attention_and_only_the_scored_logits():
    work = [{"context": "abc", "candidates": ["d", "ef"]}]
    # Layer parameters 32: 64 FLOPs per input token; attention 4 x 4 x 2 = 32 per attended position; a logit row 80.
    context = 3 * 64 + 32 * (1 + 2 + 3) + 80  # three tokens, attending 1, 2, 3 positions; the last position's logits
    one_token = 0  # " d" is only a target: read from the context's last position
    two_tokens = 64 + 80 + 32 * 4  # "e" is an input at position 4 and its logits score "f"
    assert bench.necessary_flops(TwoLayerModel(), CharTokenizer(), work) == context + one_token + two_tokens
