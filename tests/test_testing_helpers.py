"""specpilot.testing: bitwise equality, derived tolerances, non-finite patterns; conftest poisoning."""

import pytest
import torch

from specpilot.testing import assert_bitwise_equal, assert_close, bits_of, error_bound


def test_bitwise_distinguishes_signed_zero():
    pos, neg = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert bool((pos == neg).all())  # equal as values...
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise_equal(neg, pos)  # ...but not as bits
    assert_bitwise_equal(neg.clone(), neg)


@pytest.mark.parametrize("dtype, quiet, other", [
    (torch.float32, 0x7FC00000, 0x7FC00001),
    (torch.bfloat16, 0x7FC0, 0x7FC1),
    (torch.float16, 0x7E00, 0x7E01),
], ids=["fp32", "bf16", "fp16"])
def test_bitwise_nan_payloads(dtype, quiet, other):
    idt = bits_of(torch.zeros(1, dtype=dtype)).dtype
    a = torch.tensor([quiet], dtype=torch.int64).to(idt).view(dtype)
    b = torch.tensor([other], dtype=torch.int64).to(idt).view(dtype)
    assert a.isnan().all() and b.isnan().all()
    assert_bitwise_equal(a, a.clone())  # NaN == NaN bitwise, though NaN != NaN as a value
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise_equal(a, b)


def test_bitwise_shape_and_dtype():
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise_equal(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert_bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))


def _matmul_case(k=4096, seed=0):
    """fp64 reference, and PyTorch's same-precision result (bf16 inputs, fp32 output)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, k, generator=g, dtype=torch.float64)
    w = torch.randn(k, 63, generator=g, dtype=torch.float64)
    ref64 = x @ w
    same = x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float()
    return ref64, same


def test_assert_close_passes_ulp_level_error():
    ref64, same = _matmul_case()
    # A different accumulation order: the same result, off by about one fp32 ulp here and there.
    ulp = torch.nextafter(same, torch.full_like(same, float("inf"))) - same
    mask = torch.rand(same.shape, generator=torch.Generator().manual_seed(1)) < 0.3
    cand = same + ulp * mask
    c = assert_close(cand, ref64, same)
    assert c.err <= c.bound and c.base_err > 0


def test_assert_close_fails_10x_error():
    ref64, same = _matmul_case()
    cand = ref64 + 10 * (same.double() - ref64)  # ten times PyTorch's error, same direction
    with pytest.raises(AssertionError, match="exceeds 2.0x"):
        assert_close(cand.float(), ref64, same)
    # The derived bound sits between the two.
    c = error_bound(cand.float(), ref64, same)
    assert c.base_err < c.bound < c.err


def test_assert_close_fails_10x_error_bf16_output():
    """With a bf16 output the floor (one unit roundoff) must not swallow the 2x rule."""
    ref64, same = _matmul_case()
    same16 = same.to(torch.bfloat16)  # PyTorch's bf16 result: error ~ bf16 output rounding
    cand = (ref64 + 10 * (same16.double() - ref64)).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="exceeds 2.0x"):
        assert_close(cand, ref64, same16)
    assert_close(same16, ref64, same16)


def test_assert_close_nan_and_inf_patterns():
    ref = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0], dtype=torch.float64)
    base = ref.float()
    assert_close(base.clone(), ref, base)  # matching non-finites pass
    bad_nan = base.clone()
    bad_nan[0] = float("nan")
    with pytest.raises(AssertionError, match="NaN pattern"):
        assert_close(bad_nan, ref, base)
    missing_nan = base.clone()
    missing_nan[1] = 0.0
    with pytest.raises(AssertionError, match="NaN pattern"):
        assert_close(missing_nan, ref, base)
    wrong_sign = base.clone()
    wrong_sign[2] = -float("inf")
    with pytest.raises(AssertionError, match="infinities"):
        assert_close(wrong_sign, ref, base)
    spurious = base.clone()
    spurious[4] = float("inf")
    with pytest.raises(AssertionError, match="infinities"):
        assert_close(spurious, ref, base)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(base[:3], ref, base)


def test_conftest_poisons_empty():
    assert torch.empty(5).isnan().all()
    assert torch.empty(2, 3, dtype=torch.bfloat16).isnan().all()
    assert torch.empty_like(torch.zeros(4)).isnan().all()
    assert (torch.empty(3, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    assert (torch.empty(3, dtype=torch.uint8) == 0xA5).all()
    assert torch.empty(2, dtype=torch.bool).all()


def test_longest_first_orders_by_recorded_seconds(tmp_path):
    """`make test-gpu`'s ordering (tests/conftest.py, SPECPILOT_TEST_ORDER): the ones the file does not name
    first in collection order, then recorded tests longest first, each followed by the shortest one left; setup
    lines and malformed lines ignored."""
    from types import SimpleNamespace

    from specpilot.testing import longest_first

    f = tmp_path / "times.tsv"
    f.write_text("passed\tcall\t3.0\tt::a\npassed\tcall\t90.5\tt::b\nfailed\tsetup\t500\tt::c\n"
                 "passed\tcall\tx\tt::d\nbroken line\npassed\tcall\t12\tt::e\n")
    items = [SimpleNamespace(nodeid=n) for n in ("t::a", "t::new1", "t::b", "t::c", "t::e", "t::new2")]
    longest_first(items, f)
    assert [i.nodeid for i in items] == ["t::new1", "t::a", "t::c", "t::e", "t::new2", "t::b"]
    odd = [SimpleNamespace(nodeid=n) for n in ("t::a", "t::b", "t::e")]
    longest_first(odd, f)
    assert [i.nodeid for i in odd] == ["t::b", "t::a", "t::e"]
