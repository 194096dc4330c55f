"""moeext: routing and weight-preparation kernels for Mixture-of-Experts models.

Importing the package loads the native library, which registers ``torch.ops.moeext.*``
(CPU implementations), and registers the fake (meta) implementations that let
``torch.compile`` trace every op.
"""

import os
import warnings

import torch  # noqa: F401  (loads libtorch before the extension that links against it)

from . import _C  # registers torch.ops.moeext.*
from . import _fake  # noqa: F401  (registers the fakes)
from . import loading, mxfp4, nn, presets, reference
from .ops import (
    biased_grouped_topk,
    biased_grouped_topk_out,
    build_info,
    cpu_isa,
    fused_router,
    fused_router_out,
    prepack_router_weight,
    programmatic_dependent_launch,
    router_gemm,
    routing_weights,
    set_cpu_isa,
    set_programmatic_dependent_launch,
    zero_tail_,
    zero_tail_tracked_,
    shuffle_weight,
    unshuffle_weight,
    e8m0_shuffle,
    e8m0_unshuffle,
)
from .ops import _programmatic_dependent_launch_from_environment
from .buffers import PersistentBuffers

__version__ = "0.1.0"


def _warn_if_the_forced_cpu_isa_is_ignored() -> None:
    # The native library reads MOEEXT_CPU_ISA once and falls back to the best path on a name
    # it does not know or a path this build or CPU lacks; a typo should not pass unnoticed.
    # Empty counts as unset (as `MOEEXT_CPU_ISA= python ...` means), not as a typo.
    forced = os.environ.get("MOEEXT_CPU_ISA")
    # "scalar" is the portable path's name before 2026-11-28.
    if forced == "scalar":
        forced = "portable"
    if not forced or forced == "auto" or forced == cpu_isa():
        return
    available = build_info()["cpu_isas_available"]
    warnings.warn(f"MOEEXT_CPU_ISA={forced!r} is not a CPU path this build and CPU run "
                  f"({', '.join(available)}); using {cpu_isa()!r}", stacklevel=2)


_warn_if_the_forced_cpu_isa_is_ignored()
set_programmatic_dependent_launch(
    _programmatic_dependent_launch_from_environment(os.environ.get("MOEEXT_ENABLE_PDL")))

__all__ = [
    "PersistentBuffers",
    "biased_grouped_topk",
    "biased_grouped_topk_out",
    "build_info",
    "cpu_isa",
    "fused_router",
    "fused_router_out",
    "loading",
    "mxfp4",
    "nn",
    "prepack_router_weight",
    "presets",
    "programmatic_dependent_launch",
    "reference",
    "router_gemm",
    "routing_weights",
    "set_cpu_isa",
    "set_programmatic_dependent_launch",
    "zero_tail_",
    "zero_tail_tracked_",
    "shuffle_weight",
    "unshuffle_weight",
    "e8m0_shuffle",
    "e8m0_unshuffle",
]
