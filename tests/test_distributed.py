"""distributed.py: the fused loss as lm_head's own forward (the ZeRO-3 / FSDP2 route, with a stand-in ZeRO-3 marker
on CPU), and the patched model forward, which behaves like a plain model: copies compute with their own weights, a
pickled model reloads, and the patch keeps neither the trainer nor its optimizer alive."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from test_trainer import make_trainer

from trl_fused_cpo import FusedCPOTrainer
from trl_fused_cpo.distributed import call_through_head
from trl_fused_cpo.loss import fused_linear_cpo_loss


def test_call_through_head_equals_direct_read_and_restores_forward():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 23, bias=False)
    hidden = torch.randn(4, 7, 8, requires_grad=True)
    labels = torch.randint(0, 23, (4, 7))
    fn = lambda h, w, b: fused_linear_cpo_loss(h, w, labels, bias=b, backend="torch")

    direct = call_through_head(head, fn, hidden)
    g_direct = torch.autograd.grad(direct.loss, (hidden, head.weight))
    head.weight.ds_id = 0  # what ZeRO-3 puts on partitioned parameters: take the head-forward route
    calls = []
    head.register_forward_pre_hook(lambda *a: calls.append(1))  # ZeRO-3 fetches parameters in such a hook
    routed = call_through_head(head, fn, hidden)
    g_routed = torch.autograd.grad(routed.loss, (hidden, head.weight))
    assert calls == [1] and type(routed) is type(direct)
    torch.testing.assert_close(routed.loss, direct.loss)
    torch.testing.assert_close(routed.chosen_logps, direct.chosen_logps)
    for a, b in zip(g_routed, g_direct, strict=True):
        torch.testing.assert_close(a, b)
    assert "forward" not in head.__dict__  # the swap is undone
    assert head(hidden).shape == (4, 7, 23)


def _trainer(tmp_path, **overrides):
    return make_trainer(FusedCPOTrainer, tmp_path, max_steps=1, learning_rate=1e-3, **overrides)


def _fused_loss(trainer, model):
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    return trainer.get_batch_loss_metrics(model, batch)[0].detach()


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "after-bf16-training"])
def test_deepcopy_computes_with_its_own_weights(tmp_path, trained):
    """``trained``: after ``train()`` in bf16, where Accelerate has wrapped the patched forward for mixed precision."""
    trainer = _trainer(tmp_path, bf16=trained)
    if trained:
        trainer.train()
    copied = copy.deepcopy(trainer.model)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=trained):
        plain = type(copied).forward(copied, ids).logits.float()  # the class forward on the copy's own weights
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, plain)
        assert not torch.equal(trainer.model(ids).logits, plain)
    # The fused path through the copy uses the copy's weights too.
    stock_copy = copy.deepcopy(copied)
    with torch.no_grad():
        for p in stock_copy.parameters():
            p.zero_()
    assert not torch.equal(_fused_loss(trainer, copied), _fused_loss(trainer, trainer.model))
    assert not torch.equal(_fused_loss(trainer, copied), _fused_loss(trainer, stock_copy))


def test_deepcopy_and_pickle_compute_the_same_as_the_original(tmp_path):
    trainer = _trainer(tmp_path)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    buffer = io.BytesIO()
    torch.save(trainer.model, buffer)  # crashed: pickling reached the trainer
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(trainer.model)
    with torch.no_grad():
        want = trainer.model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, want)
        torch.testing.assert_close(copied(ids).logits, want)
    want_loss = _fused_loss(trainer, trainer.model)
    torch.testing.assert_close(_fused_loss(trainer, copied), want_loss)
    torch.testing.assert_close(_fused_loss(trainer, loaded), want_loss)


def test_deleting_the_trainer_frees_it_and_its_optimizer(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    model = trainer.model
    trainer_ref, optimizer_ref = weakref.ref(trainer), weakref.ref(trainer.optimizer)
    del trainer
    gc.collect()
    assert trainer_ref() is None, "the model keeps the trainer alive"
    assert optimizer_ref() is None, "the optimizer state stays allocated"
    with torch.no_grad():
        assert model(torch.tensor([[1, 5, 6]])).logits.shape[-1] == model.config.vocab_size
