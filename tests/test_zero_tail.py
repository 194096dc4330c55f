"""moeext.zero_tail_ / zero_tail_tracked_ / PersistentBuffers (SPEC.md section 4)."""

import random

import pytest
import torch

import moeext

DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.uint8, torch.int8,
          torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.bool]


def _sentinel(shape, dtype, device="cpu"):
    """A buffer whose every byte is 0x5A: any write shows, for packed dtypes too."""
    if dtype == torch.bool:  # only 0 and 1 are valid bool bytes
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.full(shape, 0x5A, dtype=torch.uint8, device=device).view(dtype) \
        if dtype.itemsize == 1 else torch.full(shape, 7, dtype=dtype, device=device)


def _as_bytes(t):
    """The bytes of t, on the CPU."""
    return t.contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37,), (37, 5), (37, 3, 4)])
def test_zeroes_exactly_the_tail(device, dtype, shape):
    for new_extent, prev_extent in [(10, 20), (0, 37), (5, 100), (20, 10), (7, 7), (0, 0),
                                    (40, 50), (36, 37)]:
        buf = _sentinel(shape, dtype, device)
        expected = _sentinel(shape, dtype)  # the reference runs on the CPU
        moeext.reference.zero_tail_(expected, new_extent, prev_extent)
        moeext.zero_tail_(buf, new_extent, prev_extent)
        assert torch.equal(_as_bytes(buf), _as_bytes(expected)), (new_extent, prev_extent)


def test_strided_along_dim0(device):
    base = torch.full((40, 8), 3, dtype=torch.int32, device=device)
    buf = base[::2, :5]  # rows 2 apart, first 5 columns of each
    assert not buf.is_contiguous()
    moeext.zero_tail_(buf, 4, 15)
    expected = torch.full((40, 8), 3, dtype=torch.int32, device=device)
    expected[8:30:2, :5] = 0
    assert torch.equal(base, expected)
    # A row is one byte range whatever the stride of a size-1 dim within it says.
    base = torch.full((10, 4), 3, dtype=torch.int32, device=device)
    moeext.zero_tail_(base.as_strided((10, 1, 4), (4, 7, 1)), 3, 8)
    assert torch.equal(base.count_nonzero(1), torch.tensor([4, 4, 4, 0, 0, 0, 0, 0, 4, 4],
                                                           device=device))


def test_large_buffer_in_parallel(device):
    buf = torch.ones(1 << 22, dtype=torch.int32, device=device)  # 16 MiB: several chunks
    moeext.zero_tail_(buf, 1000, 3_000_001)
    assert int(buf[:1000].sum()) == 1000
    assert int(buf[1000:3_000_001].count_nonzero()) == 0
    assert int(buf[3_000_001:].sum()) == buf.numel() - 3_000_001


def _replay(sequence, rows, tracked, device="cpu"):
    """Runs a decode loop: shrink-tail clearing vs a full fill each step, same writes."""
    buf = torch.zeros(rows, 3, dtype=torch.int32, device=device)
    full = torch.zeros(rows, 3, dtype=torch.int32, device=device)
    state = torch.zeros(1, dtype=torch.int64, device=device)
    prev = 0
    high_water = 0
    for step, extent in enumerate(sequence):
        # Rows at or beyond the previous extent (and the high-water mark) are never written:
        # mark them so a stray write would show.
        guard_from = min(max(prev, extent), rows)
        if guard_from < rows and high_water <= guard_from:
            buf[guard_from:] = 0
        before = buf[max(prev, extent):].clone()
        if tracked:
            moeext.zero_tail_tracked_(buf, state, extent)
            assert int(state.item()) == extent
        else:
            moeext.zero_tail_(buf, extent, prev)
        assert torch.equal(buf[max(prev, extent):], before), "wrote at/after the previous extent"
        full.fill_(0)
        payload = torch.arange(step * 1000, step * 1000 + 3 * min(extent, rows),
                               dtype=torch.int32, device=device).view(-1, 3)
        buf[:extent] = payload
        full[:extent] = payload
        assert torch.equal(buf, full), f"step {step}: extents {sequence[:step + 1]}"
        high_water = max(high_water, min(extent, rows))
        prev = extent


@pytest.mark.parametrize("tracked", [False, True])
def test_any_sequence_matches_full_fill(device, tracked):
    rng = random.Random(0)
    _replay([8, 8, 3, 20, 0, 0, 5, 64, 100, 2, 64, 1], 64, tracked, device)
    for _ in range(50):
        sequence = [rng.choice([0, 1, rng.randrange(0, 80), 64, 70]) for _ in range(30)]
        _replay(sequence, 64, tracked, device)


def test_tracked_agrees_with_plain_form(device):
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        a = torch.randint(1, 9, (50, 4), dtype=torch.int16, generator=g).to(device)
        b = a.clone()
        state = torch.zeros(1, dtype=torch.int64, device=device)
        prev = 0
        for _ in range(25):
            extent = rng.randrange(0, 60)
            moeext.zero_tail_(a, extent, prev)
            moeext.zero_tail_tracked_(b, state, extent)
            assert torch.equal(a, b)
            a[:extent] = b[:extent] = rng.randrange(1, 100)
            prev = extent


def test_tracked_state_shapes_and_negative_state(device):
    buf = torch.ones(10, dtype=torch.int32, device=device)
    state = torch.tensor(7, dtype=torch.int64, device=device)  # 0-d is fine too
    moeext.zero_tail_tracked_(buf, state, 2)
    assert buf.tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1] and int(state) == 2
    state.fill_(-5)  # read as 0: nothing to zero
    moeext.zero_tail_tracked_(buf, state, 1)
    assert buf.tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1] and int(state) == 1


# Other tensors a case makes come from buf or state (new_*), so they sit on the test's device.
INVALID_CASES = [
    (lambda b, s: moeext.zero_tail_(b, -1, 3), "new_extent must be >= 0, got -1"),
    (lambda b, s: moeext.zero_tail_(b, 1, -3), "prev_extent must be >= 0, got -3"),
    (lambda b, s: moeext.zero_tail_(s.new_tensor(5), 0, 3), "buf must have at least one dimension"),
    (lambda b, s: moeext.zero_tail_(b.new_ones(8, 6)[:, ::2], 0, 3),
     "buf must have contiguous rows"),
    (lambda b, s: moeext.zero_tail_tracked_(b, s, -2), "new_extent must be >= 0, got -2"),
    (lambda b, s: moeext.zero_tail_tracked_(b, s.int(), 0), "state must hold one int64"),
    (lambda b, s: moeext.zero_tail_tracked_(b, s.new_zeros(2), 0), "state must hold one int64"),
    # Rows that share memory (a broadcast row, rows closer than their length): zeroing the
    # tail would zero rows below new_extent too.
    (lambda b, s: moeext.zero_tail_(b[:1].expand(8, 6), 2, 8), "buf has rows that share memory"),
    (lambda b, s: moeext.zero_tail_(b.as_strided((4, 6), (5, 1)), 2, 4),
     "buf has rows that share memory (stride(0) 5 < 6 elements per row)"),
    (lambda b, s: moeext.zero_tail_tracked_(b[:1].expand(8, 6), s, 2),
     "buf has rows that share memory"),
    (lambda b, s: moeext.zero_tail_tracked_(b[:4], b.view(torch.int64)[2, :1], 1),
     "state shares memory with buf"),
    # torch.ops would pass None on as an undefined tensor and name nothing.
    (lambda b, s: moeext.zero_tail_(None, 0, 3), "zero_tail_: buf must be a tensor, got None"),
    (lambda b, s: moeext.zero_tail_tracked_(b, None, 1),
     "zero_tail_tracked_: state must be a tensor, got None"),
]


@pytest.mark.parametrize("call,message", INVALID_CASES)
def test_invalid_arguments_write_nothing(device, call, message):
    buf = torch.ones(8, 6, dtype=torch.int32, device=device)
    state = torch.tensor([8], dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(buf, state)
    assert bool((buf == 1).all()) and int(state) == 8


# The rows' layout is the kernel's to check (as strides are for every op's fake).
@pytest.mark.parametrize("call,message", [
    c for c in INVALID_CASES if "rows" not in c[1] and "shares memory" not in c[1]])
def test_fake_rejects_what_the_kernel_rejects(call, message):
    buf = torch.ones(8, 6, dtype=torch.int32, device="meta")
    state = torch.empty(1, dtype=torch.int64, device="meta")
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(buf, state)


def test_tracked_state_beside_the_buffer_in_one_allocation(device):
    # Only real overlap is refused: a state stored right after the rows it tracks is fine.
    storage = torch.ones(8 * 4 + 2, dtype=torch.int32, device=device)
    buf = storage[:32].view(8, 4)
    state = storage[32:].view(torch.int64)
    state.fill_(8)
    moeext.zero_tail_tracked_(buf, state, 3)
    assert int(state) == 3 and int(buf[3:].count_nonzero()) == 0 and bool((buf[:3] == 1).all())


def test_persistent_buffers(device):
    bufs = moeext.PersistentBuffers(device=device)
    ids = bufs.allocate("req_ids", (16,), torch.int32)
    kv = bufs.allocate("kv_indices", (16, 4), torch.int64)
    assert "req_ids" in bufs and bufs["kv_indices"] is kv
    for extent in (10, 4, 12, 0, 16, 3):
        bufs.set_extent("req_ids", extent)
        bufs.set_extent("kv_indices", extent)
        assert int(ids[extent:].count_nonzero()) == 0 and int(kv[extent:].count_nonzero()) == 0
        assert bufs.extent("req_ids") == extent
        ids[:extent] = 9
        kv[:extent] = 9
    with pytest.raises(ValueError, match="new_extent must be >= 0"):
        bufs.set_extent("req_ids", -1)
    with pytest.raises(ValueError, match="exists"):
        bufs.allocate("req_ids", (4,), torch.int32)


@pytest.mark.parametrize("tracked", [False, True], ids=["plain", "tracked"])
def test_bumps_the_versions_of_what_it_writes(device, tracked):
    # As torch's own in-place ops (fill_ included): a backward through a value the zeroing
    # overwrote raises instead of using the zeros.
    def zero(buf, state, new_extent, prev_extent):
        if tracked:
            moeext.zero_tail_tracked_(buf, state, new_extent)
        else:
            moeext.zero_tail_(buf, new_extent, prev_extent)

    x = torch.randn(8, 4, device=device, requires_grad=True)
    y = x.exp()  # saves its result for the backward
    state = torch.tensor([8], dtype=torch.int64, device=device)
    before = (y._version, state._version)
    zero(y.detach(), state, 2, 8)
    assert y._version == before[0] + 1
    assert state._version == before[1] + int(tracked)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # Inference tensors have no version to bump: written inside inference mode or outside.
    with torch.inference_mode():
        buf = torch.ones(8, 4, device=device)
        state = torch.tensor([8], dtype=torch.int64, device=device)
        zero(buf, state, 3, 8)
    assert int(buf[:3].count_nonzero()) == 12 and int(buf[3:].count_nonzero()) == 0
    zero(buf, state, 1, 3)
    assert int(buf[:1].count_nonzero()) == 4 and int(buf[1:].count_nonzero()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradient_through_the_zeroed_rows_matches_the_reference(device, dtype):
    # As torch's own zero_: the zeroed rows pass no gradient back, the others pass it on.
    # The buffer is a value of the graph, or a row-strided view of one.
    for view, new_extent, prev_extent in [(False, 3, 9), (True, 2, 5), (False, 0, 40),
                                          (True, 4, 4), (False, 6, 2), (True, 0, 0)]:
        results = []
        for impl in (moeext, moeext.reference):
            torch.manual_seed(0)
            x = torch.randn(11, 3, 2, device=device, dtype=dtype, requires_grad=True)
            y = x * 1.5
            impl.zero_tail_(y[1::2] if view else y, new_extent, prev_extent)
            g = torch.randn(11, 2, 3, device=device, dtype=dtype).transpose(1, 2)
            (y * g).sum().backward()
            results.append((y.detach(), x.grad))
        assert torch.equal(results[0][0], results[1][0]), (view, new_extent, prev_extent)
        assert torch.equal(results[0][1], results[1][1]), (view, new_extent, prev_extent)


def test_refuses_a_leaf_that_requires_grad_and_writes_nothing(device):
    # torch's in-place ops refuse these too: the leaf is the value its gradient is taken at.
    x = torch.ones(6, 2, device=device, requires_grad=True)
    for buf, message in [(x, "zero_tail_: buf is a leaf tensor that requires grad"),
                         (x[1:], "zero_tail_: buf is a view of a leaf tensor that requires grad")]:
        with pytest.raises(RuntimeError, match=message):
            moeext.zero_tail_(buf, 2, 6)
        assert bool((x == 1).all()) and x._version == 0
    # A view autograd cannot rewrite gets torch's own explanation, also before any write.
    y = x * 2
    row = y.unbind(0)[0]
    with pytest.raises(RuntimeError, match="multiple views"):
        moeext.zero_tail_(row, 0, 2)
    with torch.no_grad():
        rows = y[1:]
    with pytest.raises(RuntimeError, match="A view was created in no_grad mode"):
        moeext.zero_tail_(rows, 0, 2)
    assert bool((y == 2).all())
    # Under no_grad the leaf is written, as with torch's zero_.
    with torch.no_grad():
        moeext.zero_tail_(x, 2, 6)
    assert int(x[:2].count_nonzero()) == 4 and int(x[2:].count_nonzero()) == 0


def test_tracked_form_refuses_a_buffer_that_requires_grad(device):
    # Its zeroed rows depend on a device value a compiled backward cannot be trusted to keep
    # (the op's comment): no gradient rather than a wrong one under torch.compile.
    x = torch.ones(6, 2, device=device, requires_grad=True)
    state = torch.tensor([6], dtype=torch.int64, device=device)
    for buf in (x * 2, x):
        with pytest.raises(RuntimeError, match="zero_tail_tracked_: buf requires grad"):
            moeext.zero_tail_tracked_(buf, state, 2)
        assert bool(buf.ne(0).all()) and int(state) == 6 and state._version == 0
    with torch.no_grad():
        moeext.zero_tail_tracked_(x, state, 2)
    assert int(x[2:].count_nonzero()) == 0 and int(state) == 2


# The wrappers' direct calls of the ops (moeext._C.call_zero_tail[_tracked]), as the routing
# op's: taken for plain arguments, declined (NotImplemented) for anything torch.ops decides.

def test_direct_calls_are_the_ops(device):
    for rows, new_extent, prev_extent in [(37, 5, 30), (37, 30, 5), (1 << 15, 3, 1 << 15)]:
        buf = torch.ones(rows, 4, dtype=torch.int32, device=device)  # the last one: 512 KiB
        assert moeext._C.call_zero_tail(buf, new_extent, prev_extent) is None
        expected = torch.ones(rows, 4, dtype=torch.int32)
        moeext.reference.zero_tail_(expected, new_extent, prev_extent)
        assert torch.equal(buf.cpu(), expected)
        state = torch.tensor([prev_extent], dtype=torch.int64, device=device)
        buf.fill_(1)
        assert moeext._C.call_zero_tail_tracked(buf, state, new_extent) is None
        assert torch.equal(buf.cpu(), expected) and int(state) == new_extent
    with pytest.raises(RuntimeError, match="new_extent must be >= 0, got -1"):
        moeext._C.call_zero_tail(buf, -1, 3)


class _Tagged(torch.Tensor):
    pass


def test_direct_calls_decline_what_torch_ops_decides():
    import numpy

    buf = torch.ones(8, 2)
    state = torch.tensor([8])
    for args in [(buf.as_subclass(_Tagged), 2, 8), (buf, numpy.int64(2), 8), (buf, 2.0, 8),
                 (buf, True, 8), (buf, 2)]:
        assert moeext._C.call_zero_tail(*args) is NotImplemented
    for args in [(buf.as_subclass(_Tagged), state, 2), (buf, [8], 2), (buf, state, 2.5)]:
        assert moeext._C.call_zero_tail_tracked(*args) is NotImplemented
    # The wrapper then goes through torch.ops, which converts or explains.
    moeext.zero_tail_(buf, numpy.int64(2), 8)
    assert int(buf[2:].count_nonzero()) == 0 and int(buf[:2].count_nonzero()) == 4
    with pytest.raises(RuntimeError):
        moeext.zero_tail_tracked_(buf, [8], 2)
