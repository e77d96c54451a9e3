"""bench.kernel_resources compiles a Triton kernel for sm_90 here, with no GPU, and reads its resources."""

from __future__ import annotations

from bench.kernel_resources import SHAPES, kernels, resource_usage


def test_the_rope_kernel_compiles_for_hopper_without_spilling():
    fn, sig, consts = kernels(*SHAPES["smollm2"])["rope_kv"]
    usage = resource_usage(fn, sig, consts, arch=90)
    assert 0 < usage["registers"] <= 255
    assert usage["local"] == 0 and usage["stack"] == 0
