"""The meta-device live-bytes tracker the planner measures sampling with: peaks checked against hand counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_lora.plan.live_bytes import peak_bytes


def test_peak_of_a_chain_of_ops_counted_by_hand() -> None:
    """New outputs add their bytes, views add nothing and keep their storage held, dead tensors give theirs back."""
    x = torch.empty(256, device="meta")  # made before the measurement: not counted

    def chain() -> torch.Tensor:
        a = x + 1  # 1 KiB live
        b = (a * 2).view(16, 16)  # 2 KiB: the product is new, its view is not
        del a  # 1 KiB: b's storage stays (held through the view)
        c = torch.cat([b, b])  # 1 + 2 = 3 KiB: the peak
        del b
        return c[:8]  # a view: the 2 KiB of c stay held while it lives

    peak, op = peak_bytes(chain)
    assert peak == 3 * 1024
    assert op == "aten.cat.default"


def test_in_place_ops_add_nothing() -> None:
    def chain() -> torch.Tensor:
        a = torch.empty(256, device="meta")  # 1 KiB
        a.mul_(2).add_(1)
        return torch.nn.functional.silu(a, inplace=True)

    assert peak_bytes(chain)[0] == 1024


def test_autocast_on_meta_casts_as_cuda_autocast_does() -> None:
    """Under bf16 autocast a group norm of a bf16 tensor holds autocast's float32 copy of its input and a float32
    output (plus the per-group mean and rstd); a convolution casts a float32 input to bf16."""
    n = 32 * 64 * 64
    x = torch.empty(1, 32, 64, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(32, 32, 3, 3, device="meta", dtype=torch.bfloat16)

    def norm() -> torch.Tensor:
        return F.group_norm(x, 8)

    peak, _ = peak_bytes(norm, autocast=torch.bfloat16)
    assert peak == 4 * n + 4 * n + 2 * (8 * 4)  # the float32 copy, the float32 output, mean and rstd [1, 8]
    assert peak_bytes(norm)[0] == 2 * n + 2 * (8 * 2)  # without autocast: a bf16 output, no copy

    x32 = torch.empty(1, 32, 64, 64, device="meta")

    def conv() -> torch.Tensor:  # a float32 input and a bf16 weight: runs only as autocast casts the input
        return F.conv2d(x32, w, padding=1)

    assert peak_bytes(conv, autocast=torch.bfloat16)[0] == 2 * n + 2 * n  # the bf16 copy and the bf16 output


def test_an_op_seen_before_is_remade_as_it_would_run() -> None:
    """:class:`MetaOpCache`: on the meta device the outputs of an op seen before with the same arguments' shapes are
    remade, not computed: the same shapes, strides and dtypes, new storages of the same bytes, so what
    :class:`LiveBytes` counts does not change; views stay views, in-place ops and ops on real tensors run as usual."""
    from lightning_lora.plan.live_bytes import OPS, LiveBytes, MetaOpCache

    x = torch.empty(4, 96, 48, device="meta").transpose(1, 2)  # a strided input: outputs follow its layout

    def chain() -> torch.Tensor:
        t = x
        for _ in range(3):  # three blocks of the same ops on the same shapes
            h = F.gelu(t * 2 + 1)
            h.mul_(0.5)
            t = h.transpose(1, 2).transpose(1, 2) + t.softmax(-1)  # views of h
        return t

    plain = LiveBytes()
    with torch.no_grad(), plain:
        expected = chain()
    computed = OPS["computed"]
    peak, op = peak_bytes(chain)
    assert (peak, op) == (plain.peak, plain.peak_op)
    assert OPS["computed"] - computed < 10  # the first block's ops
    computed = OPS["computed"]
    assert peak_bytes(chain) == (peak, op) and OPS["computed"] == computed  # all known now: nothing computed
    with MetaOpCache():
        remade = chain()
    assert (remade.shape, remade.stride(), remade.dtype) == (expected.shape, expected.stride(), expected.dtype)
    with MetaOpCache():
        values = [torch.ones(3) * 2 for _ in range(2)]  # real tensors: computed each time
    assert all(torch.equal(v, torch.full((3,), 2.0)) for v in values)
