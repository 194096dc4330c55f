"""Fake (meta) implementations of every moeext op, in one place.

They give output shapes and dtypes without computing anything, so ``torch.compile`` and
``torch.export`` can trace the ops with symbolic sizes. They reject the arguments, shapes,
dtypes and devices the kernels reject, in the kernels' words (csrc/torch/params.cpp; dtypes
spelled as Python spells them), so such an error surfaces at trace time too. Strides and
shared memory (rows that must be contiguous or apart, outputs overlapping inputs) only the
kernels check: in a compiled graph the op raises those when it runs, before it writes
anything, as an eager call does.
"""

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")


def _check_float_dtype(op, name, t):
    torch._check(t.dtype in _FLOAT_DTYPES,
                 lambda: f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def _check_shape(t, expected, message):
    # One torch._check per size: `a == b and c == d` would guard on each comparison, and a
    # data-dependent (unbacked) batch size cannot be guarded on; torch._check records it.
    torch._check(t.dim() == len(expected), message)
    for size, want in zip(t.shape, expected):
        torch._check(size == want, message)


def _check_grouped_topk(op, gating_output, correction_bias, num_expert_group, topk_group,
                        topk, scoring_func):
    torch._check(
        gating_output.dim() == 2,
        lambda: f"{op}: gating_output must be 2-D [num_tokens, num_experts], got shape "
        f"{list(gating_output.shape)}",
    )
    _check_float_dtype(op, "gating_output", gating_output)
    num_experts = gating_output.shape[1]
    torch._check(num_experts <= 2**31 - 1,
                 lambda: f"{op}: num_experts must fit int32 expert ids, got {num_experts}")
    torch._check(num_expert_group >= 1,
                 lambda: f"{op}: num_expert_group must be >= 1, got {num_expert_group}")
    torch._check(num_experts % num_expert_group == 0,
                 lambda: f"{op}: num_expert_group ({num_expert_group}) must divide the number "
                 f"of experts ({num_experts})")
    torch._check(1 <= topk_group <= num_expert_group,
                 lambda: f"{op}: topk_group must be in [1, num_expert_group = "
                 f"{num_expert_group}], got {topk_group}")
    per_group = num_experts // num_expert_group
    torch._check(topk >= 1, lambda: f"{op}: topk must be >= 1, got {topk}")
    torch._check(topk <= topk_group * per_group,
                 lambda: f"{op}: topk ({topk}) exceeds the experts in the kept groups "
                 f"(topk_group {topk_group} x {per_group} per group)")
    if correction_bias is not None:
        _check_shape(correction_bias, (num_experts,),
                     lambda: f"{op}: correction_bias must have shape [{num_experts}], got "
                     f"{list(correction_bias.shape)}")
        _check_float_dtype(op, "correction_bias", correction_bias)
        torch._check(correction_bias.device == gating_output.device,
                     lambda: f"{op}: correction_bias is on {correction_bias.device} but "
                     f"gating_output is on {gating_output.device}")
    torch._check(scoring_func in _SCORING_FUNCS,
                 lambda: f"{op}: scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax', "
                 f"got '{scoring_func}'")


@torch.library.register_fake("moeext::biased_grouped_topk")
def _biased_grouped_topk_fake(gating_output, correction_bias, num_expert_group, topk_group,
                              topk, renormalize=True, routed_scaling_factor=1.0,
                              scoring_func="sigmoid"):
    _check_grouped_topk("biased_grouped_topk", gating_output, correction_bias,
                        num_expert_group, topk_group, topk, scoring_func)
    num_tokens = gating_output.shape[0]
    weights = gating_output.new_empty((num_tokens, topk), dtype=torch.float32)
    ids = gating_output.new_empty((num_tokens, topk), dtype=torch.int32)
    return weights, ids


@torch.library.register_fake("moeext::biased_grouped_topk_out")
def _biased_grouped_topk_out_fake(gating_output, correction_bias, topk_weights, topk_ids,
                                  num_expert_group, topk_group, renormalize=True,
                                  routed_scaling_factor=1.0, scoring_func="sigmoid"):
    op = "biased_grouped_topk_out"
    torch._check(topk_ids.dim() == 2,
                 lambda: f"{op}: topk_ids must be 2-D [num_tokens, topk], got {topk_ids.dim()}-D")
    topk = topk_ids.shape[1]
    _check_grouped_topk(op, gating_output, correction_bias, num_expert_group, topk_group, topk,
                        scoring_func)
    for name, out, dtype in (("topk_weights", topk_weights, torch.float32),
                             ("topk_ids", topk_ids, torch.int32)):
        torch._check(out.dim() == 2,
                     lambda: f"{op}: {name} must be 2-D [num_tokens, topk], got {out.dim()}-D")
        torch._check(out.dtype == dtype, lambda: f"{op}: {name} must be {dtype}, got {out.dtype}")
        torch._check(out.device == gating_output.device,
                     lambda: f"{op}: {name} is on {out.device} but gating_output is on "
                     f"{gating_output.device}")
        _check_shape(out, (gating_output.shape[0], topk),
                     lambda: f"{op}: {name} must have shape [{gating_output.shape[0]}, {topk}], "
                     f"got {list(out.shape)}")
    return None


@torch.library.register_fake("moeext::router_gemm")
def _router_gemm_fake(hidden_states, weight, out_dtype=None):
    op = "router_gemm"
    torch._check(hidden_states.dim() == 2,
                 lambda: f"{op}: hidden_states must be 2-D [num_tokens, hidden_size], got shape "
                 f"{list(hidden_states.shape)}")
    _check_float_dtype(op, "hidden_states", hidden_states)
    hidden_size = hidden_states.shape[1]
    if weight.dim() == 3:
        pairs = (hidden_size + 1) // 2
        torch._check(hidden_states.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16,
                     lambda: f"{op}: a prepacked weight and hidden_states must both be bfloat16, "
                     f"got weight {weight.dtype} and hidden_states {hidden_states.dtype}")
        torch._check(weight.shape[0] == pairs and weight.shape[2] == 2,
                     lambda: f"{op}: a prepacked weight must have shape [{pairs}, num_experts, 2] "
                     f"(ceil(hidden_size / 2) for the hidden_size {hidden_size} of "
                     f"hidden_states), got {list(weight.shape)}")
        num_experts = weight.shape[1]
    else:
        torch._check(weight.dim() == 2,
                     lambda: f"{op}: weight must be 2-D [num_experts, hidden_size] (or "
                     f"prepacked, 3-D [ceil(hidden_size / 2), num_experts, 2]), got shape "
                     f"{list(weight.shape)}")
        torch._check(weight.dtype == hidden_states.dtype,
                     lambda: f"{op}: weight must have the dtype of hidden_states "
                     f"({hidden_states.dtype}), got {weight.dtype}")
        torch._check(weight.shape[1] == hidden_size,
                     lambda: f"{op}: weight must have shape [num_experts, {hidden_size}] "
                     f"(hidden_size of hidden_states), got {list(weight.shape)}")
        num_experts = weight.shape[0]
    torch._check(weight.device == hidden_states.device,
                 lambda: f"{op}: weight is on {weight.device} but hidden_states is on "
                 f"{hidden_states.device}")
    logits_dtype = torch.float32 if out_dtype is None else out_dtype
    torch._check(logits_dtype in (torch.float32, torch.bfloat16),
                 lambda: f"{op}: out_dtype must be float32 or bfloat16 (or None for float32), "
                 f"got {logits_dtype}")
    return hidden_states.new_empty((hidden_states.shape[0], num_experts), dtype=logits_dtype)


def _check_extent(op, name, value):
    torch._check(value >= 0, lambda: f"{op}: {name} must be >= 0, got {value}")


def _check_zero_tail_buf(op, buf):
    # Its rows' layout (contiguous, apart) is left to the kernel, as strides are elsewhere.
    torch._check(buf.dim() >= 1,
                 lambda: f"{op}: buf must have at least one dimension, got a 0-d tensor")


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
                 lambda: f"{op}: state must hold one int64 (the previous extent), got "
                 f"{state.dtype} with {state.numel()} elements")
    torch._check(state.device == buf.device,
                 lambda: f"{op}: state is on {state.device} but buf is on {buf.device}")
    return None


def _check_shuffle_weight(op, w, layout, gate_up):
    torch._check(w.dim() >= 2, lambda: f"{op}: w must be at least 2-D [..., N, K], got shape "
                 f"{list(w.shape)}")
    torch._check(w.element_size() in (1, 2) and not w.is_complex(),
                 lambda: f"{op}: w must have a 1- or 2-byte dtype (uint8, int8, fp8, "
                 f"float4_e2m1fn_x2, bfloat16, float16), got {w.dtype}")
    torch._check(len(layout) == 2, lambda: f"{op}: layout must be (IN, IK), got {list(layout)}")
    band, ik = layout
    chunk = 16 // w.element_size()
    torch._check(1 <= band <= 256,
                 lambda: f"{op}: layout[0] (rows per band) must be in [1, 256], got {band}")
    torch._check(ik >= 1 and ik % (chunk // 2) == 0,
                 lambda: f"{op}: layout[1] ({ik}) must make 2 * layout[1] a multiple of {chunk} "
                 f"elements (16 bytes of {w.dtype})")
    torch._check(w.shape[-2] % band == 0,
                 lambda: f"{op}: N ({w.shape[-2]}) must be a multiple of layout[0] ({band})")
    torch._check(w.shape[-1] % (2 * ik) == 0,
                 lambda: f"{op}: K ({w.shape[-1]}) must be a multiple of 2 * layout[1] "
                 f"(2 x {ik})")
    if gate_up:
        torch._check(w.dim() == 3, lambda: f"{op}: gate_up=True needs a 3-D fused weight "
                     f"[E, 2N, K], got shape {list(w.shape)}")
        torch._check(w.shape[-2] % 32 == 0,
                     lambda: f"{op}: gate_up=True needs 2N ({w.shape[-2]}) to be a multiple of "
                     f"32 (16-row gate/up blocks)")


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


def _check_scale(op, name, t):
    torch._check(t.dtype in (torch.uint8, torch.float8_e8m0fnu),
                 lambda: f"{op}: {name} must be uint8 or float8_e8m0fnu, got {t.dtype}")


def _check_scale_experts(op, m, gate_up, num_experts):
    if not gate_up:
        return
    torch._check(num_experts is not None and num_experts >= 1,
                 lambda: f"{op}: gate_up=True needs num_experts (>= 1), got {num_experts}")
    torch._check(m % num_experts == 0 and (m // num_experts) % 32 == 0,
                 lambda: f"{op}: gate_up=True needs the scale rows ({m}) to split into "
                 f"num_experts ({num_experts}) groups of 2N rows with 2N a multiple of 32")


@torch.library.register_fake("moeext::e8m0_shuffle")
def _e8m0_shuffle_fake(scale, gate_up=False, num_experts=None):
    torch._check(scale.dim() == 2, lambda: f"e8m0_shuffle: scale must be 2-D [m, n], got shape "
                 f"{list(scale.shape)}")
    _check_scale("e8m0_shuffle", "scale", scale)
    _check_scale_experts("e8m0_shuffle", scale.shape[0], gate_up, num_experts)
    return scale.new_empty(_padded_scale_shape(scale.shape[0], scale.shape[1]))


@torch.library.register_fake("moeext::e8m0_unshuffle")
def _e8m0_unshuffle_fake(shuffled, m, n, gate_up=False, num_experts=None):
    op = "e8m0_unshuffle"
    _check_scale(op, "shuffled", shuffled)
    torch._check(m >= 0 and n >= 0, lambda: f"{op}: m and n must be >= 0, got m={m}, n={n}")
    _check_scale_experts(op, m, gate_up, num_experts)
    torch._check(tuple(shuffled.shape) == _padded_scale_shape(m, n),
                 lambda: f"{op}: shuffled must have the padded shape "
                 f"{list(_padded_scale_shape(m, n))} of a [{m}, {n}] scale, got "
                 f"{list(shuffled.shape)}")
    return shuffled.new_empty((m, n))
