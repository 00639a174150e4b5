"""Activation checkpointing: bitwise-equal gradients, fewer saved bytes, unchanged names,
dropout masks and BatchNorm statistics reproduced by the recomputation."""

import numpy as np

import zerosim.nn as nn


def checkpoint_blocks(model):
    for i in range(len(model.blocks)):
        model.blocks[i] = nn.checkpoint(model.blocks[i])
    return model


def gpt(**kwargs):
    return nn.GPT(23, 16, 3, 2, 16, seed=5, **kwargs)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 23, (4, 16)), rng.integers(0, 23, (4, 16))


def test_checkpointed_gpt_gradients_are_bitwise_equal_even_with_dropout():
    plain, ckpt = gpt(dropout=0.2), checkpoint_blocks(gpt(dropout=0.2))
    for step in range(2):  # the second step checks the dropout generators moved on alike
        idx, targets = batch(step)
        loss_plain, loss_ckpt = plain(idx, targets), ckpt(idx, targets)
        plain.backward()
        ckpt.backward(grad_scale=1.0)
        assert loss_plain == loss_ckpt
    for (name, p), (name_c, pc) in zip(
        plain.named_parameters(), ckpt.named_parameters(), strict=True
    ):
        assert name == name_c
        np.testing.assert_array_equal(p.grad, pc.grad, err_msg=name)


def test_checkpointing_keeps_fewer_activation_bytes():
    idx, targets = batch()
    plain, ckpt = gpt(), checkpoint_blocks(gpt())
    plain(idx, targets)
    ckpt(idx, targets)
    kept_plain, kept_ckpt = nn.saved_bytes(plain), nn.saved_bytes(ckpt)
    block_input = 4 * 16 * 16 * 4  # (B, T, C) float32, one per checkpointed block
    assert kept_ckpt < kept_plain / 2
    assert kept_plain - kept_ckpt > 3 * 10 * block_input  # each block saved far more
    plain.backward()
    ckpt.backward()
    assert nn.saved_bytes(plain) == nn.saved_bytes(ckpt) == 0


def test_checkpoint_keeps_names_state_dict_and_module_names():
    plain, ckpt = gpt(), checkpoint_blocks(gpt())
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    assert [n for n, _ in plain.named_modules()] == [n for n, _ in ckpt.named_modules()]
    assert isinstance(ckpt.blocks[0], nn.Checkpoint)
    assert ckpt.blocks[0].attn is ckpt.blocks[0].inner.attn
    ckpt.eval()
    assert not ckpt.blocks[0].inner.training


def test_hooks_inside_a_checkpoint_fire_again_in_the_recomputation():
    model = checkpoint_blocks(gpt())
    log = []
    for name in ("blocks.1", "blocks.1.attn"):
        m = dict(model.named_modules())[name]
        m.register_forward_pre_hook(lambda m, a, n=name: log.append(("forward_pre", n)))
        m.register_full_backward_hook(lambda m, gi, go, n=name: log.append(("backward", n)))
    model(*batch())
    model.backward()
    assert log == [
        ("forward_pre", "blocks.1"),
        ("forward_pre", "blocks.1.attn"),
        ("forward_pre", "blocks.1.attn"),  # recomputation inside the wrapper's backward
        ("backward", "blocks.1.attn"),
        ("backward", "blocks.1"),
    ]


def test_checkpointed_batchnorm_updates_running_statistics_once():
    def model():
        return nn.Sequential(
            nn.Linear(3, 4, rng=0, dtype="float64"), nn.BatchNorm1d(4, dtype="float64")
        )

    plain, ckpt = model(), model()
    ckpt[1] = nn.checkpoint(ckpt[1])
    x = np.random.default_rng(0).standard_normal((5, 3))
    g = np.random.default_rng(1).standard_normal((5, 4))
    for m in (plain, ckpt):
        m(x)
        m.backward(g)
    np.testing.assert_array_equal(plain[1].running_mean, ckpt[1].running_mean)
    assert int(ckpt[1].num_batches_tracked) == 1
    np.testing.assert_array_equal(plain[0].weight.grad, ckpt[0].weight.grad)
