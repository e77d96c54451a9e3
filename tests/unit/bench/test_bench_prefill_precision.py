"""bench/prefill_precision.py: its int8 arm computes what it says, and every arm's hooks are undone after it."""

from __future__ import annotations

import torch

from bench import prefill_precision as pp
from engine import platform_tuning
from engine.models import linear as lin


def test_the_int8_arm_multiplies_per_channel_codes_by_per_token_rows():
    torch.manual_seed(0)
    layer = lin.Linear(64, 32)
    pp._int8_copies(layer, keep_fp32=())
    codes, scale = layer.bf16
    assert codes.dtype == torch.int8 and codes.shape == (64, 32) and scale.shape == (32,)
    x = torch.randn(70, 64)
    with torch.inference_mode():
        got = pp._int8_product(x, layer.bf16, layer.bias)
        exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert 0 < (got - exact).abs().max() < 0.05 * exact.abs().max()  # int8's rounding, no more


def test_arm_hooks_force_bf16_or_swap_in_int8_and_restore_the_engine_after():
    saved = (platform_tuning.bf16_matmul_isa, platform_tuning.add_bf16_copies, lin._bf16_product)
    with pp.arm_hooks("bfloat16"):
        assert platform_tuning.bf16_matmul_isa() == "forced" and lin._bf16_product is saved[2]
    with pp.arm_hooks("int8 W8A8, down_proj fp32"):
        assert lin._bf16_product is pp._int8_product
        model = torch.nn.Module()
        model.down_proj, model.up = lin.Linear(8, 8), lin.Linear(8, 8)
        platform_tuning.add_bf16_copies(model)
        assert model.down_proj.bf16 is None and isinstance(model.up.bf16, tuple)
    assert (platform_tuning.bf16_matmul_isa, platform_tuning.add_bf16_copies, lin._bf16_product) == saved
