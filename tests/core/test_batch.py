"""`Batch` columns of any rank through concat/select/split, and token lists padded into [B, T] with their mask."""

from __future__ import annotations

import pytest
import torch

from rlcore import Batch, RlcoreError
from rlcore.batch import pad_tokens, pad_width


def test_pad_tokens_right_and_left():
    ids, mask = pad_tokens([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_tokens([[5, 6, 7], [8]], pad_id=9, left=True)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_concat_pads_any_rank_along_dim_1():
    """Top-k distillation columns are [B, T, k]: concat pads them to the widest T like [B, T] ones."""
    a = Batch(ids=torch.ones(2, 3, dtype=torch.long), topk=torch.ones(2, 3, 4), seq=torch.arange(2), text=["a", "b"])
    b = Batch(ids=torch.full((1, 5), 2), topk=torch.full((1, 5, 4), 2.0), seq=torch.arange(1), text=["c"])
    joined = Batch.concat([a, Batch(), b], pad_value={"topk": -1.0})
    assert joined["ids"].shape == (3, 5) and joined["topk"].shape == (3, 5, 4)
    assert joined["ids"][:2, 3:].eq(0).all() and joined["ids"][2].eq(2).all()
    assert joined["topk"][:2, 3:].eq(-1).all() and joined["topk"][:2, :3].eq(1).all() and joined["topk"][2].eq(2).all()
    assert joined["seq"].tolist() == [0, 1, 0] and joined["text"] == ["a", "b", "c"]
    four = Batch.concat([Batch(x=torch.zeros(1, 2, 3, 2)), Batch(x=torch.ones(1, 4, 3, 2))])["x"]
    assert four.shape == (2, 4, 3, 2) and four[0].sum() == 0 and four[1].sum() == 24


def test_concat_refuses_tensors_that_differ_beyond_dim_1():
    with pytest.raises(RlcoreError, match=r"column 'topk'.*\(1, 3, 4\), \(1, 3, 5\)"):
        Batch.concat([Batch(topk=torch.zeros(1, 3, 4)), Batch(topk=torch.zeros(1, 3, 5))])


def test_select_split_and_chunks_keep_trailing_dims():
    batch = Batch(topk=torch.arange(5 * 3 * 2).view(5, 3, 2), n=list(range(5)))
    assert batch.select([4, 0])["topk"].tolist() == [batch["topk"][4].tolist(), batch["topk"][0].tolist()]
    shards = batch.split(2)
    assert [s["topk"].shape for s in shards] == [(3, 3, 2), (2, 3, 2)]
    assert torch.equal(Batch.concat(shards)["topk"], batch["topk"])
    assert [c["n"] for c in batch.chunks(2)] == [[0, 1], [2, 3], [4]]


def test_pad_width_pads_dim_1_of_any_rank():
    t = torch.ones(2, 1, 3, dtype=torch.bool)
    padded = pad_width(t, 3, False)
    assert padded.shape == (2, 3, 3) and padded.dtype == torch.bool and padded[:, 1:].sum() == 0
    assert pad_width(t, 1) is t


def test_right_padded_is_read_on_the_cpu_only():
    from rlcore.batch import right_padded

    assert right_padded(torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]]))  # a fully padded row too
    assert right_padded(torch.ones(2, 4, dtype=torch.bool))
    assert not right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]]))  # left padding
    assert not right_padded(torch.tensor([[1, 0, 1]]))  # a hole
    assert not right_padded(torch.ones(2, 3, device="meta"))  # not read where reading would wait for a device
    assert not right_padded(None) and not right_padded(torch.ones(3))
