"""Token lists padded into [B, T] tensors with their mask, on either side."""

from __future__ import annotations

import torch

from rlcore.batch import pad_tokens


def test_pad_tokens_right_and_left():
    ids, mask = pad_tokens([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_tokens([[5, 6, 7], [8]], pad_id=9, left=True)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
