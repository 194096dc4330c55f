"""moeext.loading.load_shard_: TP shards of padded weights (SPEC.md section 5)."""

import math

import pytest
import torch

import moeext
from moeext import loading

DTYPES = [torch.uint8, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, torch.bfloat16]
OTHER = 3  # size of the dim that is not sharded


def spec_range(width, rank, tp, padded=None):
    """SPEC section 5, written out: [r * ceil(W/tp), min(W, (r + 1) * ceil(W/tp)))."""
    per_rank = math.ceil(width / tp)
    return min(width, rank * per_rank), min(width, (rank + 1) * per_rank)


def padded_offset_range(width, rank, tp, padded):
    """The seed PR's bug: offsets from the padded per-rank size."""
    return min(width, rank * padded), min(width, (rank + 1) * padded)


def floor_range(width, rank, tp, padded=None):
    """The other bug: flooring W / tp drops the last W % tp rows."""
    return rank * (width // tp), (rank + 1) * (width // tp)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _garbage_slot(shape, dtype, device="cpu"):
    """A slot from torch.empty with every byte set to 0x5A, so any unzeroed padding shows."""
    slot = torch.empty(shape, dtype=dtype, device=device)
    slot.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).fill_(
        0x5A if dtype.itemsize == 1 else 0x5A5A)
    return slot


def _checkpoint(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if dtype.itemsize == 1:  # moved as bytes: fp4/fp8 copies need no kernel of their own then
        return torch.randint(1, 256, shape, dtype=torch.uint8, generator=g).to(device).view(dtype)
    # No zeros: padding stays visible.
    return (torch.rand(shape, generator=g) + 0.5).to(dtype).to(device)


def _shape(width_along_dim, dim):
    return (width_along_dim, OTHER) if dim == 0 else (OTHER, width_along_dim)


def _check_slot(slot, ckpt, dim, rank, tp, fused, range_fn):
    """The slot holds exactly range_fn's rows at its start (per half if fused), zeros after."""
    slot, ckpt = _bytes(slot).cpu(), _bytes(ckpt).cpu()
    halves = 2 if fused else 1
    width, padded = ckpt.size(dim) // halves, slot.size(dim) // halves
    start, stop = range_fn(width, rank, tp, padded)
    for h in range(halves):
        got = _bytes(slot.narrow(dim, h * padded, padded))
        src = _bytes(ckpt.narrow(dim, h * width, width))
        assert torch.equal(got.narrow(dim, 0, stop - start), src.narrow(dim, start, stop - start))
        tail = got.narrow(dim, stop - start, padded - (stop - start))
        assert int(tail.count_nonzero()) == 0


def _load_all_ranks(ckpt, dim, tp, padded, fused, dtype=None, device="cpu"):
    slots, ranges = [], []
    halves = 2 if fused else 1
    for rank in range(tp):
        slot = _garbage_slot(_shape(halves * padded, dim), dtype or ckpt.dtype, device)
        ranges.append(loading.load_shard_(slot, ckpt, dim, rank, tp, fused_gate_up=fused))
        slots.append(slot)
    return slots, ranges


def _concat_unpadded(slots, ranges, dim, padded, fused):
    """Every rank's loaded rows, in rank order (gate halves first, then up halves), on the CPU."""
    halves = 2 if fused else 1
    parts = [_bytes(s).cpu().narrow(dim, h * padded, stop - start)
             for h in range(halves) for s, (start, stop) in zip(slots, ranges)]
    return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("width", [7, 8, 90, 2880])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_every_rank(device, tp, width, dim, fused):
    """Slots on the device, the checkpoint on the CPU (as read from a file)."""
    halves = 2 if fused else 1
    per_rank = math.ceil(width / tp)
    for dtype in DTYPES:
        ckpt = _checkpoint(_shape(halves * width, dim), dtype, seed=width * tp + dim)
        for padded in (per_rank, per_rank + 5, -(-per_rank // 64) * 64):
            slots, ranges = _load_all_ranks(ckpt, dim, tp, padded, fused, device=device)
            for rank, slot in enumerate(slots):
                assert ranges[rank] == spec_range(width, rank, tp)
                _check_slot(slot, ckpt, dim, rank, tp, fused, spec_range)
            assert torch.equal(_concat_unpadded(slots, ranges, dim, padded, fused), _bytes(ckpt))


def test_empty_ranks_are_all_zeros(device):
    # W=7 over 8 ranks: ranks 0..6 one row each, rank 7 none. W=90 over 8: ceil 12, rank 7
    # gets rows 84..89 (6 of 12). Checkpoints on the device too, here.
    ckpt = _checkpoint((7, OTHER), torch.uint8, seed=0, device=device)
    slot = _garbage_slot((1, OTHER), torch.uint8, device)
    assert loading.load_shard_(slot, ckpt, 0, 7, 8) == (7, 7)
    assert int(slot.count_nonzero()) == 0
    ckpt = _checkpoint((OTHER, 10), torch.bfloat16, seed=0, device=device)
    slot = _garbage_slot((OTHER, 4), torch.bfloat16, device)  # 10 over 4 ranks: 3, 3, 3, 1
    assert loading.load_shard_(slot, ckpt, 1, 3, 4) == (9, 10)
    assert torch.equal(slot[:, 0], ckpt[:, 9]) and int(slot[:, 1:].count_nonzero()) == 0
    ckpt = _checkpoint((OTHER, 0), torch.uint8, seed=0, device=device)
    slot = _garbage_slot((OTHER, 2), torch.uint8, device)
    assert loading.load_shard_(slot, ckpt, 1, 0, 2) == (0, 0)
    assert int(slot.count_nonzero()) == 0
    # A slot of no elements (no rows; the shard dim 8 wide) returns its range, writes nothing.
    ckpt = _checkpoint((0, 16), torch.bfloat16, seed=0, device=device)
    empty = torch.empty(0, 8, dtype=torch.bfloat16, device=device)
    assert loading.load_shard_(empty, ckpt, 1, 1, 2) == (8, 16)


@pytest.mark.parametrize("bad_rule", [padded_offset_range, floor_range])
@pytest.mark.parametrize("fused", [False, True])
def test_checks_catch_the_spec_bugs(bad_rule, fused):  # CPU only: it tests the checks above
    """The checks above fail for loaders that take offsets from the padded size or floor W/tp.

    W=90 on tp=8 with 32-row padded slots: ceil gives 12 rows per rank (last rank 6);
    padded offsets start rank 3 at row 96 > 90 and load nothing; flooring gives 11 rows per
    rank and drops rows 88, 89.
    """
    width, tp, padded = 90, 8, 32
    halves = 2 if fused else 1
    ckpt = _checkpoint((halves * width, OTHER), torch.uint8, seed=3)
    slots, ranges = _load_all_ranks(ckpt, 0, tp, padded, fused)

    def buggy_slot(rank):
        start, stop = bad_rule(width, rank, tp, padded)
        slot = torch.zeros(halves * padded, OTHER, dtype=torch.uint8)
        for h in range(halves):
            slot[h * padded: h * padded + stop - start] = \
                ckpt[h * width + start: h * width + stop]
        return slot, (start, stop)

    buggy = [buggy_slot(rank) for rank in range(tp)]
    # A buggy loader's slots fail the per-rank check and the concatenation check ...
    with pytest.raises(AssertionError):
        for rank, (slot, _) in enumerate(buggy):
            _check_slot(slot, ckpt, 0, rank, tp, fused, spec_range)
    spec_ranges = [spec_range(width, rank, tp) for rank in range(tp)]
    assert not torch.equal(_concat_unpadded([s for s, _ in buggy], spec_ranges, 0, padded,
                                            fused), ckpt)
    assert torch.equal(_concat_unpadded(slots, spec_ranges, 0, padded, fused), ckpt)
    # ... and differ from what load_shard_ wrote.
    assert any(not torch.equal(s, b) for s, (b, _) in zip(slots, buggy))
    # load_shard_'s slots pass the per-rank check against the spec rule, not the buggy one.
    with pytest.raises(AssertionError):
        for rank, slot in enumerate(slots):
            _check_slot(slot, ckpt, 0, rank, tp, fused, bad_rule)


def test_w13_and_w2_of_an_mxfp4_expert(device):
    """A gpt-oss-like layout: w13 [E, 2I, H/2] bytes sharded on dim 1 (fused), w2 [E, H, I/2]
    on dim 2, slots padded to 64 intermediate rows, one expert view at a time.

    I=94 on tp=4: w13 rows split 24, 24, 24, 22 and w2's 47 packed bytes 12, 12, 12, 11, the
    same elements (the byte split matches the row split only because ceil(I/tp) is even).
    """
    experts, hidden, inter, tp, rank, padded = 2, 64, 94, 4, 3, 64
    w13 = _checkpoint((experts, 2 * inter, hidden // 2), torch.uint8, seed=1)
    w2 = _checkpoint((experts, hidden, inter // 2), torch.uint8, seed=2)
    w13_param = _garbage_slot((experts, 2 * padded, hidden // 2), torch.float4_e2m1fn_x2, device)
    w2_param = _garbage_slot((experts, hidden, padded // 2), torch.float4_e2m1fn_x2, device)
    for e in range(experts):
        assert loading.load_shard_(w13_param[e], w13[e], 0, rank, tp,
                                   fused_gate_up=True) == (72, 94)
        assert loading.load_shard_(w2_param[e], w2[e], 1, rank, tp) == (36, 47)
    w13b, w2b = w13_param.view(torch.uint8).cpu(), w2_param.view(torch.uint8).cpu()
    assert torch.equal(w13b[:, :22], w13[:, 72:inter])
    assert torch.equal(w13b[:, padded:padded + 22], w13[:, inter + 72:])
    assert int(w13b[:, 22:padded].count_nonzero()) == 0
    assert int(w13b[:, padded + 22:].count_nonzero()) == 0
    assert torch.equal(w2b[:, :, :11], w2[:, :, 36:])
    assert int(w2b[:, :, 11:].count_nonzero()) == 0


@pytest.mark.parametrize("slot_dtype, ckpt_dtype", [
    (torch.float4_e2m1fn_x2, torch.uint8), (torch.uint8, torch.float4_e2m1fn_x2),
    (torch.float8_e8m0fnu, torch.uint8), (torch.uint8, torch.float8_e8m0fnu),
    (torch.float8_e4m3fn, torch.uint8),
])
def test_bytes_copy_across_byte_dtypes(device, slot_dtype, ckpt_dtype):
    ckpt = _checkpoint((OTHER, 11), ckpt_dtype, seed=4, device=device)
    slot = _garbage_slot((OTHER, 8), slot_dtype, device)
    assert loading.load_shard_(slot, ckpt, -1, 1, 2) == (6, 11)
    assert torch.equal(slot.view(torch.uint8)[:, :5], ckpt.view(torch.uint8)[:, 6:])
    assert int(slot.view(torch.uint8)[:, 5:].count_nonzero()) == 0


def test_strided_slots(device):
    ckpt = _checkpoint((10, 6), torch.bfloat16, seed=5, device=device)
    # Rows not adjacent (every other row of a bigger buffer), and a column window: both are
    # written only where the slot is, the rest of the base untouched.
    base = _garbage_slot((16, 6), torch.bfloat16, device)
    before = base.clone()
    loading.load_shard_(base[::2], ckpt, 0, 1, 2)  # rows 5..9 into 8 slot rows
    assert torch.equal(base[0:10:2], ckpt[5:10]) and int(base[10::2].count_nonzero()) == 0
    assert torch.equal(base[1::2], before[1::2])
    base = _garbage_slot((8, 10), torch.bfloat16, device)
    before = base.clone()
    loading.load_shard_(base[:, 2:8], ckpt, 0, 0, 2)  # rows 0..4 into 8 rows of 6 columns
    assert torch.equal(base[:5, 2:8], ckpt[:5]) and int(base[5:, 2:8].count_nonzero()) == 0
    assert torch.equal(base[:, :2], before[:, :2]) and torch.equal(base[:, 8:], before[:, 8:])


def test_padding_uses_zero_tail_where_rows_are_contiguous(monkeypatch, device):
    calls = []
    real = loading.zero_tail_

    def spy(buf, new_extent, prev_extent):
        calls.append((tuple(buf.shape), new_extent, prev_extent))
        real(buf, new_extent, prev_extent)

    monkeypatch.setattr(loading, "zero_tail_", spy)
    ckpt = _checkpoint((20, 4), torch.uint8, seed=6, device=device)
    slot = _garbage_slot((16, 4), torch.float4_e2m1fn_x2, device)
    loading.load_shard_(slot, ckpt, 0, 1, 2, fused_gate_up=True)  # halves: 10 -> 5 rows each
    assert calls == [((8, 4), 5, 8), ((8, 4), 5, 8)]
    _check_slot(slot, ckpt, 0, 1, 2, True, spec_range)
    calls.clear()
    # Any stride along dim 0 is fine for zero_tail_ as long as each row is one byte range.
    base = _garbage_slot((16, 8), torch.uint8, device)
    loading.load_shard_(base[:, :4], ckpt, 0, 1, 2)
    assert calls == [((16, 4), 10, 16)]
    assert torch.equal(base[:10, :4], ckpt[10:]) and int(base[10:, :4].count_nonzero()) == 0
    assert bool((base[:, 4:] == 0x5A).all())
    calls.clear()
    loading.load_shard_(_garbage_slot((4, 16), torch.uint8, device), ckpt.t(), 1, 1, 2)  # dim 1
    base = _garbage_slot((16, 8), torch.uint8, device)
    loading.load_shard_(base[:, ::2], ckpt, 0, 1, 2)  # rows not contiguous: narrow + zero_
    assert calls == []
    assert torch.equal(base[:10, ::2], ckpt[10:]) and int(base[10:, ::2].count_nonzero()) == 0
    assert bool((base[:, 1::2] == 0x5A).all())


# ---------------------------------------------------------------- invalid arguments


@pytest.mark.parametrize("slot_shape, ckpt_shape, kwargs, match", [
    ((4, 3), (8, 3), dict(shard_dim=0, tp_rank=0, tp_size=0), "tp_size must be"),
    ((4, 3), (8, 3), dict(shard_dim=0, tp_rank=-1, tp_size=2), "tp_rank must be"),
    ((4, 3), (8, 3), dict(shard_dim=0, tp_rank=2, tp_size=2), "tp_rank must be"),
    ((4, 3), (8, 3), dict(shard_dim=2, tp_rank=0, tp_size=2), "shard_dim must be"),
    ((4, 3), (8, 3), dict(shard_dim=-3, tp_rank=0, tp_size=2), "shard_dim must be"),
    ((4, 3), (8, 3), dict(shard_dim=0, tp_rank=True, tp_size=2), "tp_rank must be"),
    ((8, 3), (8, 3), dict(shard_dim=0, tp_rank=0, tp_size=True), "tp_size must be"),
    ((4, 3), (4, 3), dict(shard_dim=False, tp_rank=0, tp_size=1), "shard_dim must be"),
    ((4, 3), (8, 4), dict(shard_dim=0, tp_rank=0, tp_size=2), "dim 1 differs"),
    ((4, 3), (8, 3, 1), dict(shard_dim=0, tp_rank=0, tp_size=2), "has 2 dims"),
    ((3, 3), (7, 3), dict(shard_dim=0, tp_rank=1, tp_size=2), "ceil\\(7 / 2\\) = 4"),
    ((6, 3), (14, 3), dict(shard_dim=0, tp_rank=0, tp_size=2, fused_gate_up=True),
     "= 4 per gate/up half, got 3"),
    ((8, 3), (7, 3), dict(shard_dim=0, tp_rank=0, tp_size=1, fused_gate_up=True),
     "checkpoint_tensor.size\\(0\\) must be even"),
    ((9, 3), (8, 3), dict(shard_dim=0, tp_rank=0, tp_size=1, fused_gate_up=True),
     "param_slot.size\\(0\\) must be even"),
])
def test_invalid_arguments_raise_and_write_nothing(device, slot_shape, ckpt_shape, kwargs, match):
    slot = _garbage_slot(slot_shape, torch.uint8, device)
    ckpt = _checkpoint(ckpt_shape, torch.uint8, seed=7)
    with pytest.raises(ValueError, match=match):
        loading.load_shard_(slot, ckpt, **kwargs)
    assert bool((slot == 0x5A).all())


@pytest.mark.parametrize("slot_dtype, ckpt_dtype", [
    (torch.bfloat16, torch.float16), (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu),
    (torch.uint8, torch.bfloat16), (torch.int8, torch.float8_e4m3fn),
])
def test_incompatible_dtypes_raise_and_write_nothing(device, slot_dtype, ckpt_dtype):
    slot = _garbage_slot((4, 3), slot_dtype, device)
    before = slot.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="cannot be loaded into param_slot dtype"):
        loading.load_shard_(slot, _checkpoint((8, 3), ckpt_dtype, seed=8), 0, 0, 2)
    assert torch.equal(slot.view(torch.uint8), before)


def test_slots_torch_cannot_write_whole_raise_before_any_write(device):
    ckpt = torch.arange(16.0).view(8, 2)
    # An expanded slot: its first row would be copied before zero_tail_ refused the buffer.
    row = torch.full((1, 2), 7.0, device=device)
    with pytest.raises(ValueError, match="param_slot has elements that share memory"):
        loading.load_shard_(row.expand(4, 2), ckpt, 0, 1, 2)
    assert bool((row == 7).all())
    # Rows that overlap without a zero stride, which torch's overlap check cannot decide:
    # refused before the copy, not by zero_tail_ after it (nor written over, along dim 1).
    raw = torch.full((6,), 7.0, device=device)
    for slot, checkpoint, dim in ((raw.as_strided((3, 2), (1, 1)), ckpt, 0),
                                  (raw.as_strided((2, 3), (2, 1)), ckpt.t(), 1)):
        with pytest.raises(ValueError, match="param_slot has elements that share memory"):
            loading.load_shard_(slot, checkpoint.to(device), dim, 1, 4)
        assert bool((raw == 7).all())
    # Views of one tensor whose elements are apart all load: steps, permutes, narrows.
    base = torch.zeros(4, 6, device=device)
    loading.load_shard_(base[:, ::3], ckpt[:4], 0, 0, 1)
    loading.load_shard_(base.t()[1::3].t(), ckpt[:4], 0, 0, 1)
    assert base[:, 0::3].tolist() == ckpt[:4].tolist() == base[:, 1::3].tolist()
    # An inference tensor: copy_ writes the gate half before the up half is refused.
    with torch.inference_mode():
        slot = torch.full((4, 2), 7.0, device=device)
    with pytest.raises(ValueError, match="param_slot is an inference tensor"):
        loading.load_shard_(slot, ckpt, 0, 0, 2, fused_gate_up=True)
    assert bool((slot == 7).all())
    with torch.inference_mode():  # where it is writable, it loads
        loading.load_shard_(slot, ckpt, 0, 0, 2, fused_gate_up=True)
    assert slot.tolist() == [[0, 1], [2, 3], [8, 9], [10, 11]]
    slot = torch.full((4, 2), 7.0, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="param_slot requires grad; .* torch.no_grad"):
        loading.load_shard_(slot, ckpt, 0, 0, 2)
    with torch.no_grad():
        loading.load_shard_(slot, ckpt, 0, 1, 2)
    assert slot.tolist() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    slot = torch.full((4, 2), 7.0, device=device)
    with pytest.raises(ValueError, match="checkpoint_tensor is on the meta device"):
        loading.load_shard_(slot, ckpt.to("meta"), 0, 0, 2)
    assert bool((slot == 7).all())


def test_a_checkpoint_sharing_the_slots_memory_is_refused(device):
    base = torch.arange(24.0, device=device).view(12, 2)
    before = base.clone()
    overlap = "param_slot and checkpoint_tensor overlap in memory"
    with pytest.raises(ValueError, match=overlap):
        loading.load_shard_(base[:4], base[2:10], 0, 0, 2)
    # Columns of one tensor share no element, but their ranges intersect: refused as well.
    with pytest.raises(ValueError, match=overlap + r" \(their byte ranges in one storage"):
        loading.load_shard_(base[:, :1], base[:, 1:], 0, 0, 1)
    assert torch.equal(base, before)
    raw = torch.full((16,), 7, dtype=torch.uint8, device=device)  # sharing one byte: refused
    with pytest.raises(ValueError, match=overlap):
        loading.load_shard_(raw[:4].view(4, 1), raw[3:11].view(8, 1), 0, 0, 2)
    assert bool((raw == 7).all())
    loading.load_shard_(base[:4], base[4:12], 0, 1, 2)  # apart in one allocation: fine
    assert torch.equal(base[:4], before[8:12])


def test_non_tensor_arguments():
    with pytest.raises(ValueError, match="checkpoint_tensor must be a torch.Tensor"):
        loading.load_shard_(torch.zeros(2, 2), [[1.0, 2.0]], 0, 0, 1)
    with pytest.raises(ValueError, match="tp_rank must be"):
        loading.load_shard_(torch.zeros(2, 2), torch.zeros(2, 2), 0, 0.0, 1)


def test_shard_range_checks_its_arguments():
    assert loading.shard_range(7, 7, 8) == (7, 7) and loading.shard_range(0, 0, 1) == (0, 0)
    for args, match in (((-1, 0, 1), "width must be an int >= 0, got -1"),
                        ((7.0, 0, 1), "width must be"), ((True, 0, 1), "width must be"),
                        ((7, 0, 0), "tp_size must be an int >= 1, got 0"),
                        ((7, 8, 8), r"tp_rank must be an int in \[0, tp_size=8\), got 8"),
                        ((7, -1, 8), "tp_rank must be"), ((7, False, 8), "tp_rank must be")):
        with pytest.raises(ValueError, match="shard_range: " + match):
            loading.shard_range(*args)


def test_exported_from_package():
    assert moeext.loading.load_shard_ is loading.load_shard_
    assert "loading" in moeext.__all__ and "mxfp4" in moeext.__all__
    assert moeext.mxfp4.quantize is not None
