"""oneDNN linears run at bucketed row counts: right results, and few distinct shapes."""

from __future__ import annotations

import pytest
import torch

from engine.models import linear as lin


def test_buckets_are_few_and_cover_every_row_count():
    buckets = {lin.onednn_bucket(m) for m in range(lin.SKINNY_MAX_ROWS + 1, lin.ONEDNN_MAX_ROWS + 1)}
    assert buckets == {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256}
    assert all(lin.onednn_bucket(m) >= m for m in range(1, lin.ONEDNN_MAX_ROWS + 1))


@pytest.mark.skipif(not lin._onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [9, 16, 17, 100, 129, 255, 256])
def test_padded_rows_give_the_unpadded_result(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    with torch.no_grad():
        got = lin.linear(x, w, b)
        out = torch.empty(rows, 80)
        into = lin.linear(x, w, b, out=out)
    assert got.shape == (rows, 80) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.T + b, rtol=1e-5, atol=1e-4)
    assert into is out and torch.equal(out, got)


@pytest.mark.skipif(not lin._onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [1, 8, 9, 64, 100, 256, 300])
def test_prepacked_weight_gives_the_plain_result(rows):
    """Rows up to 256 read the packed copy (oneDNN: 9-256); the other paths ignore it and read the plain weight."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    packed = lin.prepack(w)
    assert packed is not None and (packed.is_mkldnn or lin.is_panel_packed(packed))
    with torch.no_grad():
        got = lin.linear(x, w, b, packed=packed)
    assert got.shape == (rows, 80)
    torch.testing.assert_close(got, x @ w.T + b, rtol=1e-5, atol=1e-4)


def test_prepack_skips_weights_its_path_never_reads():
    assert lin.prepack(torch.randn(8, 8, dtype=torch.float64)) is None
    assert lin.prepack(torch.randn(8, 8).to(torch.bfloat16)) is None


@pytest.mark.skipif(not lin._onednn_available(), reason="this torch build has no oneDNN linear")
def test_prepack_linears_packs_every_linear_and_counts_its_bytes():
    model = torch.nn.Sequential(lin.Linear(16, 32), torch.nn.ReLU(), lin.Linear(32, 8, bias=False))
    added = lin.prepack_linears(model)
    if lin.is_panel_packed(model[0].packed):
        assert added == (32 * 16 + 32 * 32) * 4  # panels of 32 output columns: the 8-wide layer is padded
    else:
        assert added == (32 * 16 + 8 * 32) * 4
    assert all(m.packed is not None for m in model if isinstance(m, lin.Linear))
    x = torch.randn(20, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.relu(x @ model[0].weight.T + model[0].bias) @ model[2].weight.T,
                                   rtol=1e-5, atol=1e-5)
    assert "packed" not in str(list(model.state_dict()))
