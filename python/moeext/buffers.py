"""Persistent buffers that are cleared by their shrinking tail only."""

from typing import Dict, Optional, Sequence

import torch

from .ops import zero_tail_

__all__ = ["PersistentBuffers"]


class PersistentBuffers:
    """Owns named buffers sized for the largest batch, and keeps each one's extent.

    Decode loops used to ``fill_(0)`` such buffers every step. When a buffer's readers only
    look below its current extent (request ids per token, paged KV indices), it is enough
    to start zeroed and, when the extent shrinks, zero the tail the previous step left:
    :meth:`set_extent` does exactly that. Rows below the new extent keep whatever the
    caller wrote; it is the caller's job to overwrite them before they are read.

    Not valid for buffers that are read past their extent (for example a buffer whose
    padding rows a kernel reads): those still need a full fill.

    The extents are Python ints, kept for eager loops: a ``torch.compile``d step that calls
    :meth:`set_extent` is guarded on the previous extent and recompiles for each one. In
    compiled code, keep the extent in a tensor with :func:`moeext.zero_tail_tracked_`.

    Example::

        bufs = PersistentBuffers(device="cpu")
        req_ids = bufs.allocate("req_ids", (max_tokens,), torch.int32)
        for batch in batches:
            bufs.set_extent("req_ids", len(batch))   # zeroes only [len(batch), previous)
            req_ids[: len(batch)] = ...
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self._buffers: Dict[str, torch.Tensor] = {}
        self._extents: Dict[str, int] = {}

    def allocate(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Allocates a zeroed buffer with extent 0 and returns it."""
        if name in self._buffers:
            raise ValueError(f"PersistentBuffers.allocate: a buffer named {name!r} exists")
        buf = torch.zeros(tuple(shape), dtype=dtype, device=self.device)
        self._buffers[name] = buf
        self._extents[name] = 0
        return buf

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def extent(self, name: str) -> int:
        """The extent last set for the buffer (0 after allocation)."""
        return self._extents[name]

    def set_extent(self, name: str, new_extent: int) -> None:
        """Sets the buffer's extent, zeroing only the rows the previous extent left over."""
        if new_extent < 0:
            raise ValueError(f"PersistentBuffers.set_extent: new_extent must be >= 0, got "
                             f"{new_extent}")
        zero_tail_(self._buffers[name], new_extent, self._extents[name])
        self._extents[name] = new_extent
