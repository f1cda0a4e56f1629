"""ConvBlock's spelled-out instance norm: torch's InstanceNorm + LeakyReLU bits, fewer copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.network.unet import NEGATIVE_SLOPE, ConvBlock


def _grad_fn_names(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn.name() in seen:
            continue
        seen.add(fn.name())
        todo += [next_fn for next_fn, _ in fn.next_functions]
    return seen


@pytest.mark.parametrize("ndim", [2, 3])
def test_block_equals_torch_instance_norm_and_leaky_relu_bit_for_bit(ndim: int) -> None:
    torch.manual_seed(0)
    block = ConvBlock(ndim, 2, 4, (3,) * ndim, (1,) * ndim)
    with torch.no_grad():  # non-trivial affine parameters
        block[1].weight.uniform_(0.5, 1.5)
        block[1].bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 2, *(6,) * ndim)

    def reference(inp: torch.Tensor) -> torch.Tensor:  # nn.Sequential's own forward
        return F.leaky_relu(block[1](block[0](inp)), NEGATIVE_SLOPE, inplace=True)

    results = []
    for forward in (block, reference):
        block.zero_grad()
        out = forward(x)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in block.parameters()], out))
    (ours, our_grads, our_out), (theirs, their_grads, their_out) = results
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(our_grads, their_grads, strict=True))
    # The point of spelling it out: no CopySlices (3 full-size copies in backward).
    assert any("CopySlices" in name for name in _grad_fn_names(their_out))
    assert not any("CopySlices" in name for name in _grad_fn_names(our_out))


def test_inference_keeps_channels_last_through_a_block() -> None:
    """CPU inference runs 3D blocks in channels_last_3d: the block's norm and activation
    must keep that layout (the training path's spelled-out batch_norm copies it back)."""
    torch.manual_seed(0)
    block = ConvBlock(3, 4, 4, (3, 3, 3), (1, 1, 1)).eval()
    z = torch.randn(1, 4, 6, 7, 8)
    with torch.no_grad():
        plain = block.norm_act(z.clone())
        fast = block.norm_act(z.to(memory_format=torch.channels_last_3d))
    assert fast.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.allclose(fast, plain, atol=1e-5)
