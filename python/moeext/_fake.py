"""Fake (meta) implementations of every moeext op, in one place.

They give output shapes and dtypes without computing anything, so ``torch.compile`` and
``torch.export`` can trace the ops with symbolic sizes. They reject the arguments, shapes,
dtypes and devices the kernels reject, with the kernels' own messages: each text is written
once, in the op's binding file (csrc/torch/ops/), and reaches Python through
``moeext._C.check_messages()`` (values are filled in as Python spells them: ``torch.float32``
where C++ prints ``Float``). Strides and shared memory (rows that must be contiguous or apart,
outputs overlapping inputs) only the kernels check: in a compiled graph the op raises those when
it runs, before it writes anything, as an eager call does.
"""

import torch

from . import _C
from .reference import is_prepacked_router_weight

_MESSAGES = _C.check_messages()
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def _message(key, **fields):
    """The kernels' message ``key``, filled in; a callable, as torch._check takes it."""
    return lambda: _MESSAGES[key].format(**fields)


def _check_float_dtype(op, arg, t):
    torch._check(t.dtype in _FLOAT_DTYPES,
                 _message("common.float_dtype", op=op, arg=arg, dtype=t.dtype))


def _check_same_device(op, arg, t, other, other_tensor):
    torch._check(t.device == other_tensor.device,
                 _message("common.same_device", op=op, arg=arg, device=t.device, other=other,
                          other_device=other_tensor.device))


def _check_shape(t, expected, message):
    # One torch._check per size: `a == b and c == d` would guard on each comparison, and a
    # data-dependent (unbacked) batch size cannot be guarded on; torch._check records it.
    torch._check(t.dim() == len(expected), message)
    for size, want in zip(t.shape, expected):
        torch._check(size == want, message)


def _check_grouped_topk(op, gating_output, correction_bias, num_expert_group, topk_group,
                        topk, scoring_func, logits_name="gating_output"):
    torch._check(gating_output.dim() == 2,
                 _message("routing.gating_output_rank", op=op, shape=list(gating_output.shape)))
    _check_float_dtype(op, "gating_output", gating_output)
    num_experts = gating_output.shape[1]
    torch._check(num_experts <= 2**31 - 1,
                 _message("routing.num_experts_int32", op=op, num_experts=num_experts))
    torch._check(num_expert_group >= 1, _message("routing.num_expert_group_positive", op=op,
                                                 num_expert_group=num_expert_group))
    torch._check(num_experts % num_expert_group == 0,
                 _message("routing.num_expert_group_divides", op=op,
                          num_expert_group=num_expert_group, num_experts=num_experts))
    torch._check(1 <= topk_group <= num_expert_group,
                 _message("routing.topk_group_range", op=op, num_expert_group=num_expert_group,
                          topk_group=topk_group))
    per_group = num_experts // num_expert_group
    torch._check(topk >= 1, _message("routing.topk_positive", op=op, topk=topk))
    torch._check(topk <= topk_group * per_group,
                 _message("routing.topk_range", op=op, topk=topk, topk_group=topk_group,
                          per_group=per_group))
    if correction_bias is not None:
        _check_shape(correction_bias, (num_experts,),
                     _message("routing.bias_shape", op=op, num_experts=num_experts,
                              shape=list(correction_bias.shape)))
        _check_float_dtype(op, "correction_bias", correction_bias)
        _check_same_device(op, "correction_bias", correction_bias, logits_name, gating_output)
    torch._check(scoring_func in _SCORING_FUNCS,
                 _message("routing.scoring_func", op=op, scoring_func=scoring_func))


def _check_options(op, gating_output, topk, num_fused_shared_experts, expert_map,
                   expert_counts, routed_experts, num_valid_tokens, logits_name="gating_output"):
    num_tokens, num_experts = gating_output.shape
    if expert_map is not None:
        size = num_experts + num_fused_shared_experts
        _check_shape(expert_map, (size,),
                     _message("routing.expert_map", op=op, size=size, dtype=expert_map.dtype,
                              shape=list(expert_map.shape)))
        torch._check(expert_map.dtype == torch.int32,
                     _message("routing.expert_map", op=op, size=size, dtype=expert_map.dtype,
                              shape=list(expert_map.shape)))
        _check_same_device(op, "expert_map", expert_map, logits_name, gating_output)
    if expert_counts is not None:
        message = _message("routing.expert_counts", op=op, num_experts=num_experts,
                           dtype=expert_counts.dtype, shape=list(expert_counts.shape))
        torch._check(expert_counts.dtype in (torch.int32, torch.int64), message)
        _check_shape(expert_counts, (num_experts,), message)
        _check_same_device(op, "expert_counts", expert_counts, logits_name, gating_output)
    if routed_experts is not None:
        message = _message("routing.routed_experts", op=op, topk=topk, num_tokens=num_tokens,
                           dtype=routed_experts.dtype, shape=list(routed_experts.shape))
        torch._check(routed_experts.dtype in (torch.int16, torch.int32), message)
        torch._check(routed_experts.dim() == 2, message)
        torch._check(routed_experts.shape[0] >= num_tokens, message)
        torch._check(routed_experts.shape[1] == topk, message)
        torch._check(routed_experts.dtype != torch.int16 or num_experts <= 32767,
                     _message("routing.routed_experts_int16", op=op, num_experts=num_experts))
        _check_same_device(op, "routed_experts", routed_experts, logits_name, gating_output)
    if num_valid_tokens is not None:
        torch._check(num_valid_tokens.dtype in (torch.int32, torch.int64)
                     and num_valid_tokens.numel() == 1,
                     _message("routing.num_valid_tokens", op=op, dtype=num_valid_tokens.dtype,
                              numel=num_valid_tokens.numel()))
        _check_same_device(op, "num_valid_tokens", num_valid_tokens, logits_name,
                           gating_output)


@torch.library.register_fake("moeext::biased_grouped_topk")
def _biased_grouped_topk_fake(gating_output, correction_bias, num_expert_group, topk_group,
                              topk, renormalize=True, routed_scaling_factor=1.0,
                              scoring_func="sigmoid", num_fused_shared_experts=0,
                              shared_expert_weight=1.0, expert_map=None, expert_counts=None,
                              routed_experts=None, num_valid_tokens=None):
    op = "biased_grouped_topk"
    _check_grouped_topk(op, gating_output, correction_bias, num_expert_group, topk_group, topk,
                        scoring_func)
    torch._check(num_fused_shared_experts >= 0, _message(
        "routing.num_fused_shared_experts", op=op, shared=num_fused_shared_experts))
    _check_options(op, gating_output, topk, num_fused_shared_experts, expert_map,
                   expert_counts, routed_experts, num_valid_tokens)
    num_tokens = gating_output.shape[0]
    columns = topk + num_fused_shared_experts
    weights = gating_output.new_empty((num_tokens, columns), dtype=torch.float32)
    ids = gating_output.new_empty((num_tokens, columns), dtype=torch.int32)
    return weights, ids


def _check_out_columns(op, topk_ids, num_fused_shared_experts):
    """The out= forms' topk_ids: 2-D with a routed column beside the shared experts; topk."""
    torch._check(topk_ids.dim() == 2,
                 _message("routing.output_rank", op=op, arg="topk_ids", dim=topk_ids.dim()))
    torch._check(num_fused_shared_experts >= 0, _message(
        "routing.num_fused_shared_experts", op=op, shared=num_fused_shared_experts))
    columns = topk_ids.shape[1]
    topk = columns - num_fused_shared_experts
    torch._check(num_fused_shared_experts == 0 or topk >= 1,
                 _message("routing.out_columns", op=op, columns=columns,
                          shared=num_fused_shared_experts))
    return topk


def _check_outputs(op, gating_output, topk_weights, topk_ids, columns,
                   logits_name="gating_output"):
    """The out= forms' topk_weights and topk_ids: [num_tokens, columns] float32 / int32."""
    for arg, out, dtype in (("topk_weights", topk_weights, torch.float32),
                            ("topk_ids", topk_ids, torch.int32)):
        torch._check(out.dim() == 2, _message("routing.output_rank", op=op, arg=arg,
                                              dim=out.dim()))
        torch._check(out.dtype == dtype, _message("routing.output_dtype", op=op, arg=arg,
                                                  expected=dtype, dtype=out.dtype))
        _check_same_device(op, arg, out, logits_name, gating_output)
        _check_shape(out, (gating_output.shape[0], columns),
                     _message("routing.output_shape", op=op, arg=arg,
                              num_tokens=gating_output.shape[0], columns=columns,
                              shape=list(out.shape)))


@torch.library.register_fake("moeext::biased_grouped_topk_out")
def _biased_grouped_topk_out_fake(gating_output, correction_bias, topk_weights, topk_ids,
                                  num_expert_group, topk_group, renormalize=True,
                                  routed_scaling_factor=1.0, scoring_func="sigmoid",
                                  num_fused_shared_experts=0, shared_expert_weight=1.0,
                                  expert_map=None, expert_counts=None, routed_experts=None,
                                  num_valid_tokens=None):
    op = "biased_grouped_topk_out"
    topk = _check_out_columns(op, topk_ids, num_fused_shared_experts)
    columns = topk_ids.shape[1]
    _check_grouped_topk(op, gating_output, correction_bias, num_expert_group, topk_group, topk,
                        scoring_func)
    _check_outputs(op, gating_output, topk_weights, topk_ids, columns)
    _check_options(op, gating_output, topk, num_fused_shared_experts, expert_map,
                   expert_counts, routed_experts, num_valid_tokens)
    return None


@torch.library.register_fake("moeext::routing_weights")
def _routing_weights_fake(gating_output, topk_ids, renormalize=True, routed_scaling_factor=1.0,
                          scoring_func="sigmoid"):
    op = "routing_weights"
    torch._check(gating_output.dim() == 2,
                 _message("routing.gating_output_rank", op=op, shape=list(gating_output.shape)))
    _check_float_dtype(op, "gating_output", gating_output)
    torch._check(topk_ids.dim() == 2 and topk_ids.dtype in (torch.int16, torch.int32,
                                                            torch.int64),
                 _message("routing_weights.ids", op=op, num_tokens=gating_output.shape[0],
                          dtype=topk_ids.dtype, shape=list(topk_ids.shape)))
    _check_shape(topk_ids, (gating_output.shape[0], topk_ids.shape[1]),
                 _message("routing_weights.ids", op=op, num_tokens=gating_output.shape[0],
                          dtype=topk_ids.dtype, shape=list(topk_ids.shape)))
    _check_same_device(op, "topk_ids", topk_ids, "gating_output", gating_output)
    torch._check(scoring_func in _SCORING_FUNCS,
                 _message("routing.scoring_func", op=op, scoring_func=scoring_func))
    return gating_output.new_empty(topk_ids.shape, dtype=torch.float32)


def _check_router_gemm(op, hidden_states, weight):
    """The checks of router_gemm's inputs; returns num_experts."""
    torch._check(hidden_states.dim() == 2, _message("router_gemm.hidden_states_rank", op=op,
                                                    shape=list(hidden_states.shape)))
    _check_float_dtype(op, "hidden_states", hidden_states)
    hidden_size = hidden_states.shape[1]
    if is_prepacked_router_weight(weight):
        pairs = (hidden_size + 1) // 2
        torch._check(hidden_states.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16,
                     _message("router_gemm.packed_dtype", op=op, weight_dtype=weight.dtype,
                              hidden_dtype=hidden_states.dtype))
        torch._check(weight.shape[0] == pairs and weight.shape[2] == 2,
                     _message("router_gemm.packed_shape", op=op, pairs=pairs,
                              hidden_size=hidden_size, shape=list(weight.shape)))
        num_experts = weight.shape[1]
    else:
        torch._check(weight.dim() == 2,
                     _message("router_gemm.weight_rank", op=op, shape=list(weight.shape)))
        torch._check(weight.dtype == hidden_states.dtype,
                     _message("router_gemm.weight_dtype", op=op,
                              hidden_dtype=hidden_states.dtype, dtype=weight.dtype))
        torch._check(weight.shape[1] == hidden_size,
                     _message("router_gemm.weight_shape", op=op, hidden_size=hidden_size,
                              shape=list(weight.shape)))
        num_experts = weight.shape[0]
    _check_same_device(op, "weight", weight, "hidden_states", hidden_states)
    return num_experts


@torch.library.register_fake("moeext::router_gemm")
def _router_gemm_fake(hidden_states, weight, out_dtype=None):
    op = "router_gemm"
    num_experts = _check_router_gemm(op, hidden_states, weight)
    logits_dtype = torch.float32 if out_dtype is None else out_dtype
    torch._check(logits_dtype in (torch.float32, torch.bfloat16),
                 _message("router_gemm.out_dtype", op=op, dtype=logits_dtype))
    return hidden_states.new_empty((hidden_states.shape[0], num_experts), dtype=logits_dtype)


@torch.library.register_fake("moeext::fused_router")
def _fused_router_fake(hidden_states, weight, correction_bias, num_expert_group, topk_group, topk,
                       renormalize=True, routed_scaling_factor=1.0, scoring_func="sigmoid",
                       num_fused_shared_experts=0, shared_expert_weight=1.0, expert_map=None,
                       expert_counts=None, routed_experts=None, num_valid_tokens=None,
                       return_logits=False):
    op = "fused_router"
    num_experts = _check_router_gemm(op, hidden_states, weight)
    num_tokens = hidden_states.shape[0]
    logits = hidden_states.new_empty((num_tokens, num_experts), dtype=torch.float32)
    _check_grouped_topk(op, logits, correction_bias, num_expert_group, topk_group, topk,
                        scoring_func, logits_name="hidden_states")
    torch._check(num_fused_shared_experts >= 0, _message(
        "routing.num_fused_shared_experts", op=op, shared=num_fused_shared_experts))
    _check_options(op, logits, topk, num_fused_shared_experts, expert_map, expert_counts,
                   routed_experts, num_valid_tokens, logits_name="hidden_states")
    columns = topk + num_fused_shared_experts
    weights = hidden_states.new_empty((num_tokens, columns), dtype=torch.float32)
    ids = hidden_states.new_empty((num_tokens, columns), dtype=torch.int32)
    if not return_logits:
        logits = hidden_states.new_empty((0, num_experts), dtype=torch.float32)
    return weights, ids, logits


@torch.library.register_fake("moeext::fused_router_out")
def _fused_router_out_fake(hidden_states, weight, correction_bias, topk_weights, topk_ids,
                           num_expert_group, topk_group, renormalize=True,
                           routed_scaling_factor=1.0, scoring_func="sigmoid",
                           num_fused_shared_experts=0, shared_expert_weight=1.0,
                           expert_map=None, expert_counts=None, routed_experts=None,
                           num_valid_tokens=None):
    op = "fused_router_out"
    num_experts = _check_router_gemm(op, hidden_states, weight)
    topk = _check_out_columns(op, topk_ids, num_fused_shared_experts)
    columns = topk_ids.shape[1]
    num_tokens = hidden_states.shape[0]
    logits = hidden_states.new_empty((num_tokens, num_experts), dtype=torch.float32)
    _check_grouped_topk(op, logits, correction_bias, num_expert_group, topk_group, topk,
                        scoring_func, logits_name="hidden_states")
    _check_outputs(op, logits, topk_weights, topk_ids, columns, logits_name="hidden_states")
    _check_options(op, logits, topk, num_fused_shared_experts, expert_map, expert_counts,
                   routed_experts, num_valid_tokens, logits_name="hidden_states")
    return None


def _check_extent(op, arg, value):
    torch._check(value >= 0, _message("zero_tail.extent", op=op, arg=arg, value=value))


def _check_zero_tail_buf(op, buf):
    # Its rows' layout (contiguous, apart) is left to the kernel, as strides are elsewhere.
    torch._check(buf.dim() >= 1, _message("zero_tail.buf_rank", op=op))


@torch.library.register_fake("moeext::zero_tail_")
def _zero_tail_fake(buf, new_extent, prev_extent):
    _check_extent("zero_tail_", "new_extent", new_extent)
    _check_extent("zero_tail_", "prev_extent", prev_extent)
    _check_zero_tail_buf("zero_tail_", buf)
    return None


@torch.library.register_fake("moeext::zero_tail_tracked_")
def _zero_tail_tracked_fake(buf, state, new_extent):
    op = "zero_tail_tracked_"
    _check_extent(op, "new_extent", new_extent)
    _check_zero_tail_buf(op, buf)
    torch._check(state.dtype == torch.int64 and state.numel() == 1,
                 _message("zero_tail.state", op=op, dtype=state.dtype, numel=state.numel()))
    _check_same_device(op, "state", state, "buf", buf)
    return None


def _check_shuffle_weight(op, w, layout, gate_up):
    torch._check(w.dim() >= 2, _message("shuffle_weight.rank", op=op, shape=list(w.shape)))
    torch._check(w.element_size() in (1, 2) and not w.is_complex(),
                 _message("shuffle_weight.dtype", op=op, dtype=w.dtype))
    torch._check(len(layout) == 2,
                 _message("shuffle_weight.layout_pair", op=op, layout=list(layout)))
    band, ik = layout
    chunk = 16 // w.element_size()
    torch._check(1 <= band <= 256, _message("shuffle_weight.band_range", op=op, band=band))
    torch._check(ik >= 1 and ik % (chunk // 2) == 0,
                 _message("shuffle_weight.chunk_multiple", op=op, ik=ik, chunk=chunk,
                          dtype=w.dtype))
    torch._check(w.shape[-2] % band == 0,
                 _message("shuffle_weight.rows_multiple", op=op, rows=w.shape[-2], band=band))
    torch._check(w.shape[-1] % (2 * ik) == 0,
                 _message("shuffle_weight.columns_multiple", op=op, k=w.shape[-1], ik=ik))
    if gate_up:
        torch._check(w.dim() == 3,
                     _message("shuffle_weight.gate_up_rank", op=op, shape=list(w.shape)))
        torch._check(w.shape[-2] % 32 == 0,
                     _message("shuffle_weight.gate_up_rows", op=op, rows=w.shape[-2]))


@torch.library.register_fake("moeext::shuffle_weight")
def _shuffle_weight_fake(w, layout=(16, 16), gate_up=False):
    _check_shuffle_weight("shuffle_weight", w, layout, gate_up)
    return torch.empty_like(w, memory_format=torch.contiguous_format)


@torch.library.register_fake("moeext::unshuffle_weight")
def _unshuffle_weight_fake(w, layout=(16, 16), gate_up=False):
    _check_shuffle_weight("unshuffle_weight", w, layout, gate_up)
    return torch.empty_like(w, memory_format=torch.contiguous_format)


def _padded_scale_shape(m, n):
    return (m + 255) // 256 * 256, (n + 7) // 8 * 8


def _check_scale(op, arg, t):
    torch._check(t.dtype in (torch.uint8, torch.float8_e8m0fnu),
                 _message("e8m0_shuffle.dtype", op=op, arg=arg, dtype=t.dtype))


def _check_scale_experts(op, m, gate_up, num_experts):
    if not gate_up:
        return
    torch._check(num_experts is not None and num_experts >= 1,
                 _message("e8m0_shuffle.num_experts_needed", op=op, num_experts=num_experts))
    torch._check(m % num_experts == 0 and (m // num_experts) % 32 == 0,
                 _message("e8m0_shuffle.num_experts_split", op=op, m=m,
                          num_experts=num_experts))


@torch.library.register_fake("moeext::e8m0_shuffle")
def _e8m0_shuffle_fake(scale, gate_up=False, num_experts=None):
    op = "e8m0_shuffle"
    torch._check(scale.dim() == 2,
                 _message("e8m0_shuffle.scale_rank", op=op, shape=list(scale.shape)))
    _check_scale(op, "scale", scale)
    _check_scale_experts(op, scale.shape[0], gate_up, num_experts)
    return scale.new_empty(_padded_scale_shape(scale.shape[0], scale.shape[1]))


@torch.library.register_fake("moeext::e8m0_unshuffle")
def _e8m0_unshuffle_fake(shuffled, m, n, gate_up=False, num_experts=None):
    op = "e8m0_unshuffle"
    _check_scale(op, "shuffled", shuffled)
    torch._check(m >= 0 and n >= 0, _message("e8m0_shuffle.sizes", op=op, m=m, n=n))
    _check_scale_experts(op, m, gate_up, num_experts)
    padded_m, padded_n = _padded_scale_shape(m, n)
    torch._check(tuple(shuffled.shape) == (padded_m, padded_n),
                 _message("e8m0_shuffle.padded_shape", op=op, padded_m=padded_m,
                          padded_n=padded_n, m=m, n=n, shape=list(shuffled.shape)))
    return shuffled.new_empty((m, n))
