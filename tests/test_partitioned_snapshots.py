"""A weight snapshot read back from a checkpoint must hold what each rank holds of every weight (its ZeRO-3
partition, or the whole weight): one saved under another partitioning is refused when the checkpoint loads, naming
the snapshot and the weight, never read torn (:func:`llmrl.engine.model.partitioned_snapshots.check_held`)."""

from __future__ import annotations

import pytest
import torch

from llmrl.engine.model.partitioned_snapshots import check_held, held


def partitioned(shard_numel: int) -> torch.nn.Parameter:
    """A weight as ZeRO-3 leaves it between calls: empty, its partition in ``ds_tensor``."""
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_id, param.ds_tensor = 7, torch.zeros(shard_numel)
    return param


def test_a_snapshot_holding_this_ranks_share_of_every_weight_is_taken():
    params = {"whole": torch.nn.Parameter(torch.zeros(3, 4)), "split": partitioned(6)}
    assert held(params["split"]).shape == (6,) and held(params["whole"]).shape == (3, 4)
    check_held(params, "ref", {"whole": torch.ones(3, 4), "split": torch.ones(6)})


@pytest.mark.parametrize("frozen, named", [({"split": torch.ones(5)}, r"holds split as \(5,\).*holds \(6,\)"),
                                           ({"whole": torch.ones(4, 3)}, r"holds whole as \(4, 3\)"),
                                           ({"gone": torch.ones(2)}, r"holds gone as \(2,\).*holds nothing")])
def test_a_snapshot_saved_under_another_partitioning_is_refused_naming_it(frozen, named):
    params = {"whole": torch.nn.Parameter(torch.zeros(3, 4)), "split": partitioned(6)}
    with pytest.raises(ValueError, match=rf"weight snapshot 'ref' {named}.*another replica count"):
        check_held(params, "ref", frozen)
