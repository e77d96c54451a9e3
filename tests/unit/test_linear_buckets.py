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
