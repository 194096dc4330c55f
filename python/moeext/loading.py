"""Loading tensor-parallel shards of checkpoint weights into padded parameters (docs/SPEC.md §5).

A parameter may be wider than the checkpoint's per-rank share (MXFP4 rounds the intermediate
size up), so the slice a rank reads is computed from the checkpoint width, never from the
padded width: with checkpoint width ``W`` along the shard dim, rank ``r`` of ``tp_size`` reads
``[r * ceil(W / tp_size), min(W, (r + 1) * ceil(W / tp_size)))``, copies it to the start of its
slot and zeroes the rest. Offsets taken from the padded width make the last ranks read past the
data; flooring ``W / tp_size`` drops the last ``W % tp_size`` rows.
"""

from typing import Tuple

import torch

from .ops import zero_tail_

__all__ = ["load_shard_", "shard_range"]


# isinstance(True, int) holds, but True as a rank, a size or a dim is a caller's slip.
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tp(op: str, tp_rank: int, tp_size: int) -> None:
    if not _is_int(tp_size) or tp_size < 1:
        raise ValueError(f"{op}: tp_size must be an int >= 1, got {tp_size!r}")
    if not _is_int(tp_rank) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"{op}: tp_rank must be an int in [0, tp_size={tp_size}), got "
                         f"{tp_rank!r}")


def shard_range(width: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """The rows ``[start, stop)`` of a dimension of ``width`` that rank ``tp_rank`` loads.

    ``start == stop`` (possibly ``== width``) for a rank past the data, e.g. ``width=7``,
    ``tp_size=8``: ranks 0..6 get one row each, rank 7 none.

    Raises:
        ValueError: naming the argument, unless ``width >= 0``, ``tp_size >= 1`` and
        ``0 <= tp_rank < tp_size`` are ints (a bool is refused).
    """
    op = "shard_range"
    if not _is_int(width) or width < 0:
        raise ValueError(f"{op}: width must be an int >= 0, got {width!r}")
    _check_tp(op, tp_rank, tp_size)
    return _shard_range(width, tp_rank, tp_size)


def _shard_range(width: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    per_rank = -(-width // tp_size)
    return min(width, tp_rank * per_rank), min(width, (tp_rank + 1) * per_rank)


def _as_bytes_if_1byte(t: torch.Tensor) -> torch.Tensor:
    # fp4/fp8 storage dtypes lack fill_ and strided copy_ kernels on some devices; their bytes
    # are all there is to copy or zero.
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _byte_compatible(slot_dtype: torch.dtype, ckpt_dtype: torch.dtype) -> bool:
    # Same dtype, or raw bytes on one side: checkpoints often store fp4 pairs and E8M0 scales
    # as uint8. Anything else (bf16 into fp16, fp4 into e8m0) would be a conversion or a mixup,
    # not a load.
    if slot_dtype == ckpt_dtype:
        return True
    one_byte = slot_dtype.itemsize == 1 and ckpt_dtype.itemsize == 1
    return one_byte and torch.uint8 in (slot_dtype, ckpt_dtype)


def _rows_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for d in range(t.dim() - 1, 0, -1):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _elements_apart(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, its dims taken in order of stride.

    Each dim (of size > 1) must step past all that the smaller-stride dims span. Views of a
    dense tensor (slices with steps, narrows, selects, permutes) always do; torch's own check
    answers "too hard" for most non-contiguous views, and so let an as_strided slot that
    overlaps itself through. Dims that interleave without sharing an element (strides 2 and 3
    over sizes 3 and 2, say) count as not apart.
    """
    if t.numel() == 0:
        return True
    span = 0  # the largest offset the dims taken so far reach
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def _byte_span(t: torch.Tensor) -> Tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check_slot_writable(op: str, slot: torch.Tensor, ckpt: torch.Tensor) -> None:
    # What torch's copy_ and zero_tail_ would refuse, and slots whose elements overlap (their
    # result would depend on the order of the writes), refused before the first write: a
    # fused slot's gate half is copied before its up half could fail, and every copy before
    # the zeroing.
    if not _elements_apart(slot):
        raise ValueError(f"{op}: param_slot has elements that share memory, or dims that "
                         f"interleave (shape {tuple(slot.shape)}, strides {slot.stride()}, e.g. "
                         f"an expanded view); every element needs memory of its own")
    if slot.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{op}: param_slot is an inference tensor, writable only inside "
                         f"torch.inference_mode()")
    if slot.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{op}: param_slot requires grad; loading records no gradient, so "
                         f"call it under torch.no_grad()")
    if ckpt.is_meta and not slot.is_meta:
        raise ValueError(f"{op}: checkpoint_tensor is on the meta device (shape only, no data) "
                         f"but param_slot is on {slot.device}")
    if (slot.device == ckpt.device and not slot.is_meta and slot.numel() > 0
            and ckpt.numel() > 0):
        (slot_begin, slot_end), (ckpt_begin, ckpt_end) = _byte_span(slot), _byte_span(ckpt)
        if slot_begin < ckpt_end and ckpt_begin < slot_end:
            # Spans, not elements: interleaved views of one tensor are refused too.
            raise ValueError(f"{op}: param_slot and checkpoint_tensor overlap in memory (their "
                             f"byte ranges in one storage intersect); the checkpoint must be a "
                             f"tensor of its own")


def _has_zero_tail_kernel(device: torch.device) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "moeext::zero_tail_", key)


def _load_part(slot: torch.Tensor, ckpt: torch.Tensor, dim: int, start: int, stop: int) -> None:
    """Copies ``ckpt[start:stop]`` along ``dim`` to the front of ``slot`` and zeroes the rest."""
    count = stop - start
    slot_bytes, ckpt_bytes = _as_bytes_if_1byte(slot), _as_bytes_if_1byte(ckpt)
    if count > 0:
        slot_bytes.narrow(dim, 0, count).copy_(ckpt_bytes.narrow(dim, start, count))
    padded = slot.size(dim)
    if count == padded:
        return
    # Padding along dim 0 of a slot whose rows are contiguous is one byte range per row: that
    # is exactly zero_tail_'s job. Any other dim is strided, so it takes a narrow view.
    if dim == 0 and _rows_contiguous(slot) and _has_zero_tail_kernel(slot.device):
        zero_tail_(slot, count, padded)
    else:
        slot_bytes.narrow(dim, count, padded - count).zero_()


def load_shard_(
    param_slot: torch.Tensor,
    checkpoint_tensor: torch.Tensor,
    shard_dim: int,
    tp_rank: int,
    tp_size: int,
    fused_gate_up: bool = False,
) -> Tuple[int, int]:
    """Loads rank ``tp_rank``'s shard of ``checkpoint_tensor`` into ``param_slot`` (padded).

    With ``W = checkpoint_tensor.size(shard_dim)``, copies checkpoint rows
    ``[start, stop) = [r * ceil(W / tp_size), min(W, (r + 1) * ceil(W / tp_size)))`` along
    ``shard_dim`` to the first ``stop - start`` positions of ``param_slot`` and zeroes the rest
    of the slot along ``shard_dim`` (the slot may come from ``torch.empty``). A rank past the
    data (``start == stop``) leaves its slot all zeros.

    ``fused_gate_up=True`` is for a fused w13 whose shard dim holds ``[gate W | up W]`` in the
    checkpoint (``2W``) and ``[gate P | up P]`` in the slot (``2P``): each half is sliced with
    the rule above into its own half of the slot, and each half's padding is zeroed.

    Args:
        param_slot: this rank's parameter (or one expert's view of it), any dtype and strides,
            with ``size(shard_dim) >= ceil(W / tp_size)`` (per half when fused) and every other
            dim equal to the checkpoint's. Written in place.
        checkpoint_tensor: the full, unsharded checkpoint tensor, same dtype as the slot, or
            bytes of it: when one side is uint8 the other may be any 1-byte dtype
            (``torch.float4_e2m1fn_x2`` packed pairs, ``torch.float8_e8m0fnu`` scales, fp8), and
            the bytes are copied as they are. May sit on another device than the slot.
        shard_dim: the dimension to shard, negative counts from the end (w13 ``[2I, H]`` shards
            dim 0, w2 ``[H, I]`` dim 1). Widths are counted in the tensor's own units: bytes
            (2 elements) for fp4 packed along the shard dim, 32-element blocks for scales. Tensors
            that must hold the same elements per rank (w2's bytes and its scales, w13's rows)
            agree only when ``ceil(W / tp_size)`` is a whole number of the coarsest unit (e.g.
            I = 2880 on tp 8: 360 rows, 180 bytes, but ceil(90 / 8) = 12 scale blocks = 384);
            the caller picks shapes or a checkpoint view in common units for that.
        tp_rank, tp_size: ``0 <= tp_rank < tp_size``, ``tp_size >= 1``.
        fused_gate_up: the shard dim is a gate half followed by an up half, in both tensors.

    Returns:
        ``(start, stop)``: the checkpoint rows read along ``shard_dim`` (within each half when
        fused); ``stop - start`` rows were loaded (per half) and the rest of the slot zeroed.

    Raises:
        ValueError: naming the argument, for any argument outside the above, and for a slot
        and checkpoint whose byte ranges intersect (views of one tensor, even interleaved
        ones that share no element); nothing is written then.
    """
    op = "load_shard_"
    for name, t in (("param_slot", param_slot), ("checkpoint_tensor", checkpoint_tensor)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    _check_tp(op, tp_rank, tp_size)
    ndim = param_slot.dim()
    if checkpoint_tensor.dim() != ndim:
        raise ValueError(f"{op}: param_slot has {ndim} dims but checkpoint_tensor has "
                         f"{checkpoint_tensor.dim()} (shapes {tuple(param_slot.shape)} and "
                         f"{tuple(checkpoint_tensor.shape)})")
    if not _is_int(shard_dim) or not -ndim <= shard_dim < ndim:
        raise ValueError(f"{op}: shard_dim must be an int in [{-ndim}, {ndim}) for "
                         f"{ndim}-d tensors, got {shard_dim!r}")
    dim = shard_dim % ndim
    for d in range(ndim):
        if d != dim and param_slot.size(d) != checkpoint_tensor.size(d):
            raise ValueError(f"{op}: param_slot {tuple(param_slot.shape)} and checkpoint_tensor "
                             f"{tuple(checkpoint_tensor.shape)} must agree on every dim but "
                             f"shard_dim={shard_dim}; dim {d} differs")
    if not _byte_compatible(param_slot.dtype, checkpoint_tensor.dtype):
        raise ValueError(f"{op}: checkpoint_tensor dtype {checkpoint_tensor.dtype} cannot be "
                         f"loaded into param_slot dtype {param_slot.dtype} (same dtype, or "
                         f"uint8 bytes against a 1-byte dtype)")
    _check_slot_writable(op, param_slot, checkpoint_tensor)

    width, padded = checkpoint_tensor.size(dim), param_slot.size(dim)
    if fused_gate_up:
        for name, t in (("checkpoint_tensor", checkpoint_tensor), ("param_slot", param_slot)):
            if t.size(dim) % 2 != 0:
                raise ValueError(f"{op}: with fused_gate_up, {name}.size({shard_dim}) must be "
                                 f"even ([gate | up]), got {t.size(dim)}")
        width, padded = width // 2, padded // 2
    per_rank = -(-width // tp_size)
    if padded < per_rank:
        half = " per gate/up half" if fused_gate_up else ""
        raise ValueError(f"{op}: param_slot.size({shard_dim}) must hold ceil(W / tp_size) = "
                         f"ceil({width} / {tp_size}) = {per_rank}{half}, got {padded}{half}")

    start, stop = _shard_range(width, tp_rank, tp_size)  # checked above
    if fused_gate_up:
        for half in range(2):
            _load_part(param_slot.narrow(dim, half * padded, padded),
                       checkpoint_tensor.narrow(dim, half * width, width), dim, start, stop)
    else:
        _load_part(param_slot, checkpoint_tensor, dim, start, stop)
    return start, stop
