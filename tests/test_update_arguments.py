"""update()'s arguments are refused on the client when any number inside them, however nested, is NaN or infinite:
ragged lists of lists, lists of tensors, numpy arrays, dicts; the error names the argument and the path of the
bad value. Finite arguments of every shape pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmrl.engine.errors import InvalidArgument
from llmrl.engine.requests.finite import check_finite

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, where", [
    ({"rewards": [[1.0, 2.0], [3.0, 4.0, NAN]]}, "rewards[1][2]"),  # ragged: torch.as_tensor refuses it
    ({"old_logprobs": [torch.zeros(3), torch.tensor([0.0, -INF])]}, "old_logprobs[1][1]"),
    ({"old_logprobs": [np.zeros(2), np.array([[0.0], [INF]])]}, "old_logprobs[1][1][0]"),
    ({"stats": {"a": [1.0], "b": {"c": [0.5, [NAN]]}}}, "stats['b']['c'][1][0]"),
    ({"advantages": torch.tensor([[0.0, 1.0], [NAN, 2.0]])}, "advantages[1][0]"),
    ({"returns": np.array([1.0, INF], dtype=np.float32)}, "returns[1]"),
    ({"beta": NAN}, "beta"),
    ({"beta": np.float64(INF)}, "beta"),
    ({"pairs": [(1.0, 2.0), (3.0, NAN)]}, "pairs[1][1]"),
    ({"mixed": [1, "text", [2.0, NAN]]}, "mixed[2][1]"),
])
def test_a_non_finite_number_anywhere_is_refused_naming_its_path(kwargs, where):
    with pytest.raises(InvalidArgument, match="nothing was sent") as info:
        check_finite(kwargs)
    assert f"at {where} " in str(info.value), str(info.value)
    assert repr(next(iter(kwargs))) in str(info.value)


def test_finite_arguments_of_every_shape_pass():
    check_finite({"rewards": [[1.0, 2.0], [3.0]], "tensors": [torch.zeros(2), torch.ones(3, 2)],
                  "arrays": [np.zeros(2), np.ones((2, 2), dtype=np.float16)], "ints": [1, 2, 3], "flag": True,
                  "names": ["a", "b"], "nested": {"x": [1e38, -1e38]}, "objects": [object()], "none": None,
                  "ids": torch.arange(5), "bools": np.array([True, False])})
