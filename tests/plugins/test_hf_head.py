"""The LM head in chunks (`rlcore.head`) against a plain log-softmax of the whole logits: values and
gradients, through TRL's kernel and through the torch chunks; the train engine's chunked outputs against its
logits path; and no [N, V] tensor on the chunked path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlcore import Batch
from rlcore import head
from rlcore.plugins.hf.train import HFTrainEngine

N, H, V = 37, 16, 300


def inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g) if bias else None
    return hidden, weight, b, torch.randint(0, V, (N,), generator=g)


def leaves(*tensors):
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def grads(*tensors):
    return [None if t is None else t.grad for t in tensors]


class LargestTensor(TorchDispatchMode):
    """Records the largest storage (bytes) behind any tensor an operator returns, in forward, recomputation and
    backward alike (a view counts as the storage it views, so an expand allocates nothing)."""

    def __init__(self, *held: torch.Tensor):
        super().__init__()
        self.most = 0
        self.held = {t.untyped_storage().data_ptr() for t in held}  # storages that exist already (a view of W)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.held:
                self.most = max(self.most, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("use_trl", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_a_plain_log_softmax_with_gradients(use_trl, temperature):
    hidden, weight, bias, targets = inputs()
    mine, theirs = leaves(hidden, weight, bias), leaves(hidden, weight, bias)
    got = head.token_logprobs(*mine, targets, temperature, chunk=8, use_trl=use_trl)
    logits = (theirs[0] @ theirs[1].T + theirs[2]) / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = torch.linspace(-1, 2, N)  # any upstream gradient, not only ones
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    for a, b in zip(grads(*mine), grads(*theirs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads(*mine)[1].abs().sum() > 0


def test_logprobs_at_topk_and_full_equal_the_plain_log_softmax():
    hidden, weight, bias, _ = inputs(1)
    ids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(3))
    mine, theirs = leaves(hidden, weight, bias), leaves(hidden, weight, bias)
    full = torch.log_softmax((theirs[0] @ theirs[1].T + theirs[2]) / 0.8, -1)
    got = head.logprobs_at(*mine, ids, 0.8, chunk=6)
    torch.testing.assert_close(got, full.gather(-1, ids), atol=1e-5, rtol=1e-5)
    got.sum().backward()
    full.gather(-1, ids).sum().backward()
    for a, b in zip(grads(*mine), grads(*theirs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    scores = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    at = head.logits_at(*scores, ids, 0.8, chunk=6)  # the logits: off from the log-probs by each row's logsumexp
    plain = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = (plain[0] @ plain[1].T + plain[2]) / 0.8
    torch.testing.assert_close(at, logits.gather(-1, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.log_softmax(at, -1), torch.log_softmax(got, -1), atol=1e-5, rtol=1e-5)
    (at * torch.linspace(-1, 1, 5)).sum().backward()
    (logits.gather(-1, ids) * torch.linspace(-1, 1, 5)).sum().backward()
    for a, b in zip(scores, plain):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    values, top = head.topk_logprobs(hidden, weight, bias, 4, 0.8, chunk=6)
    reference = full.detach().topk(4, -1)
    torch.testing.assert_close(values, reference.values)
    assert torch.equal(top, reference.indices)
    torch.testing.assert_close(head.full_logprobs(hidden, weight, bias, 0.8), full.detach())


def test_a_head_adapter_gives_the_merged_heads_values_and_the_factors_gradients_without_a_merged_weight():
    """`HeadAdapter` (LoRA on the head): every chunked function equals the plain log-softmax of the merged weight
    W + s * B @ A, with the gradients of h, W, A and B that autograd gives through the merge; no [V, H] tensor
    but W itself exists (the merge would be one)."""
    hidden, weight, bias, targets = inputs(2)
    g = torch.Generator().manual_seed(4)
    a, b, scale = torch.randn(4, H, generator=g), torch.randn(V, 4, generator=g) * 0.3, 2.0
    ids = torch.randint(0, V, (N, 5), generator=g)
    mine, theirs = leaves(hidden, weight, bias, a, b), leaves(hidden, weight, bias, a, b)
    adapter = head.HeadAdapter(mine[3], mine[4], scale)
    merged = theirs[1] + scale * theirs[4] @ theirs[3]
    full = torch.log_softmax((theirs[0] @ merged.T + theirs[2]) / 0.8, -1)
    up = torch.linspace(-1, 2, N)
    got = head.token_logprobs(*mine[:3], targets, 0.8, chunk=8, use_trl=False, adapter=adapter)
    (got * up).sum().backward()
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (expected * up).sum().backward()
    for x, y in zip(grads(*mine), grads(*theirs)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    assert mine[3].grad.abs().sum() > 0 and mine[4].grad.abs().sum() > 0
    for fn, plain in ((head.logprobs_at, full), (head.logits_at, (theirs[0] @ merged.T + theirs[2]) / 0.8)):
        mine, theirs = leaves(hidden, weight, bias, a, b), leaves(hidden, weight, bias, a, b)
        merged = theirs[1] + scale * theirs[4] @ theirs[3]
        logits = (theirs[0] @ merged.T + theirs[2]) / 0.8
        reference = (torch.log_softmax(logits, -1) if fn is head.logprobs_at else logits).gather(-1, ids)
        got = fn(*mine[:3], ids, 0.8, chunk=6, adapter=head.HeadAdapter(mine[3], mine[4], scale))
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)
        (got * torch.linspace(-1, 1, 5)).sum().backward()
        (reference * torch.linspace(-1, 1, 5)).sum().backward()
        for x, y in zip(grads(*mine), grads(*theirs)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    fixed = head.HeadAdapter(a, b, scale)
    values, top = head.topk_logprobs(hidden, weight, bias, 4, 0.8, chunk=6, adapter=fixed)
    reference = full.detach().topk(4, -1)
    torch.testing.assert_close(values, reference.values)
    assert torch.equal(top, reference.indices)
    torch.testing.assert_close(head.full_logprobs(hidden, weight, bias, 0.8, fixed), full.detach())
    frozen = [hidden.clone().requires_grad_(), weight, bias, a.clone().requires_grad_(), b.clone().requires_grad_()]
    with LargestTensor(weight) as seen:  # LoRA's case: W frozen, A and B trained
        low_rank = head.HeadAdapter(frozen[3], frozen[4], scale)
        head.token_logprobs(*frozen[:3], targets, 0.8, chunk=8, use_trl=False, adapter=low_rank).sum().backward()
    assert seen.most < V * H * 4  # the merged weight would be a [V, H] float32 beside W
    dropped, plain = leaves(hidden, a, b), leaves(hidden, a, b)  # dropout on the adapter's input, as peft's
    torch.manual_seed(5)
    got = head.token_logprobs(dropped[0], weight, bias, targets, chunk=N, use_trl=False,
                              adapter=head.HeadAdapter(dropped[1], dropped[2], scale, dropout=0.5))
    torch.manual_seed(5)  # the same mask (one chunk: the first draw), which the checkpointed chunk draws again in backward
    x = torch.nn.functional.dropout(plain[0], 0.5)
    logits = plain[0] @ weight.T + bias + scale * (x @ plain[1].T) @ plain[2].T
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    for x, y in zip(grads(*dropped), grads(*plain)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="reads one head weight"):
        head.token_logprobs(hidden, weight, bias, targets, use_trl=True, adapter=fixed)


@pytest.mark.parametrize("use_trl", [False, True])
def test_the_chunked_log_probs_hold_no_tensor_of_every_row_times_the_vocabulary(use_trl):
    vocab = 40_000 if use_trl else V  # TRL's tiles are [4096, 32768] at most: a vocabulary wider than a tile
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 8, generator=g).requires_grad_()
    weight = torch.randn(vocab, 8, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (64,), generator=g)
    with LargestTensor() as seen:
        head.token_logprobs(hidden, weight, None, targets, chunk=16, use_trl=use_trl).sum().backward()
    assert seen.most < 64 * vocab * 4  # bytes of a float32 [rows, V]
    with LargestTensor() as plain:  # the check can fail: the whole log-softmax is such a tensor
        torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).sum().backward()
    assert plain.most >= 64 * vocab * 4


def make_batch(seed=0, rows=4, width=12, vocab=200):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    completion = torch.zeros_like(ids)
    completion[:, 4:] = 1
    return Batch(input_ids=ids, attention_mask=mask, completion_mask=completion * mask)


def test_the_train_engines_chunked_outputs_equal_its_logits_path_values_and_gradients(tiny_model):
    batch = make_batch()
    ids = torch.randint(0, 200, (4, 12, 3), generator=torch.Generator().manual_seed(1))
    results = {}
    for chunked in (True, False):
        engine = HFTrainEngine(str(tiny_model), chunked_lm_head=chunked, learning_rate=1e-3, max_grad_norm=0.0)
        seen, grads = {}, {}
        for name, p in engine.model.named_parameters():  # the gradient the optimizer is handed, per parameter
            p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))

        def loss_fn(outputs, micro):
            logprobs, at, full = outputs.logprobs(), outputs.logprobs_at(ids), outputs.full_logprobs()
            seen.update(logprobs=logprobs.detach(), at=at.detach(), full=full.detach(), kind=type(outputs).__name__,
                        topk=outputs.topk(5))
            loss = -(logprobs * micro["completion_mask"]).sum() + at.exp().sum() + (full.exp() * full).sum() * 0.1
            return loss, {}

        engine.train_step(batch, loss_fn, micro_batch_size=4, temperature=0.9)
        seen["forward"] = engine.forward_logprobs(batch, 0.9)
        results[chunked] = seen, grads
    (chunked, chunked_grads), (plain, plain_grads) = results[True], results[False]
    assert (chunked["kind"], plain["kind"]) == ("HeadModelOutputs", "HFModelOutputs")
    for key in ("logprobs", "at", "full", "forward"):
        torch.testing.assert_close(chunked[key], plain[key], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked["topk"].logprobs, plain["topk"].logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(chunked["topk"].ids, plain["topk"].ids)
    # The gradients, not the weights after the step: AdamW's first step is lr * g / (|g| + eps), so a gradient near
    # eps (1e-8) turns float32 rounding into a visible weight difference. Both paths sum the same terms in another
    # order, so each gradient agrees to float32 rounding at the scale of its largest entry.
    assert chunked_grads.keys() == plain_grads.keys() and chunked_grads
    tolerance = 64 * torch.finfo(torch.float32).eps
    for name, grad in chunked_grads.items():
        scale = plain_grads[name].abs().max().item()
        torch.testing.assert_close(grad, plain_grads[name], rtol=tolerance, atol=tolerance * scale, msg=name)


def test_a_forward_engines_projection_gives_its_logits(tiny_model):
    batch = make_batch(2)
    engine = HFTrainEngine(str(tiny_model), forward_only=True)
    projection = engine.forward_projection(batch)
    full = engine.forward_topk(batch, None, 1.0)
    logits = projection.hidden @ projection.weight.T
    valid = batch["attention_mask"].bool().clone()
    valid[:, 0] = False
    torch.testing.assert_close(torch.log_softmax(logits, -1)[valid], full[valid], atol=1e-5, rtol=1e-5)
    assert not projection.hidden[~valid].any()  # row 0 and padding hold nothing, as a TopK's
    assert HFTrainEngine(str(tiny_model), forward_only=True, chunked_lm_head=False).forward_projection(batch) is None
