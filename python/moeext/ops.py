"""Typed Python wrappers of ``torch.ops.moeext.*``.

The wrappers of the ops add nothing but names, defaults and documentation: each is one call
into the registered op, so they trace under ``torch.compile(fullgraph=True)`` exactly like the
op. The wrappers called at every decode step (routing, router GEMM, tail zeroing) reach their
op through a direct call in ``moeext._C`` where the arguments are of the plain Python types
(about half the time of ``torch.ops``' generic argument conversion); the op, its dispatch
and its errors are the same. Their errors of their own: None where a tensor goes raises a
RuntimeError naming the argument, where ``torch.ops`` would pass on an undefined tensor, and
a ``layout`` that is not a pair raises a TypeError. ``prepack_router_weight`` is no op but
plain PyTorch run once at load time, with its own ValueErrors.
"""

from typing import List, Optional, Tuple

import torch

from . import _C

# Bound once: the routing wrappers run at every decode step, and looking these up through
# their modules at each call cost 45 ns of a 1.2 us call. TorchScript and Dynamo know the two
# predicates by identity, so they read these names as they read the qualified ones.
_is_scripting = torch.jit.is_scripting
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_call_biased_grouped_topk = _C.call_biased_grouped_topk
_call_biased_grouped_topk_out = _C.call_biased_grouped_topk_out
_call_router_gemm = _C.call_router_gemm
_call_fused_router = _C.call_fused_router
_call_fused_router_out = _C.call_fused_router_out
_call_routing_weights = _C.call_routing_weights
_call_zero_tail = _C.call_zero_tail
_call_zero_tail_tracked = _C.call_zero_tail_tracked


# torch.ops passes None on as an undefined tensor, and then the error names no argument
# ("tensor does not have a device"), or no kernel is found where it was the only tensor.
# The wrappers check where they call torch.ops, outside TorchScript (whose types exclude None).
def _check_tensors(op: str, **tensors: Optional[torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t is None:
            raise RuntimeError(f"{op}: {name} must be a tensor, got None")


__all__ = [
    "biased_grouped_topk",
    "biased_grouped_topk_out",
    "build_info",
    "cpu_isa",
    "fused_router",
    "prepack_router_weight",
    "programmatic_dependent_launch",
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


def biased_grouped_topk(
    gating_output: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Biased grouped top-k routing (DeepSeek-V3 style), docs/SPEC.md §1, with the engine
    options of docs/SPEC.md §6.

    For each token, with every value in fp32:

    1. ``s = score(logits)`` with ``scoring_func`` one of ``"sigmoid"``,
       ``"sqrtsoftplus"`` (``sqrt(softplus(x))``) or ``"softmax"`` (over the row).
    2. ``b = s + correction_bias`` (``b = s`` without a bias); NaN in ``b`` counts as -inf.
    3. The experts form ``num_expert_group`` contiguous groups. A group scores the sum of its
       two largest ``b`` with a bias, its largest ``b`` without one. The ``topk_group`` best
       groups are kept (ties: lower group index).
    4. The ``topk`` experts with the largest ``b`` inside the kept groups are chosen (ties:
       lower expert index; -inf/NaN rank last but still yield distinct, in-group ids).
    5. Weights are the unbiased scores ``s`` of the chosen experts (NaN gives 0), divided by
       their sum + 1e-20 if ``renormalize``, then multiplied by ``routed_scaling_factor``.

    Args:
        gating_output: ``[num_tokens, num_experts]`` router logits, float32, bfloat16 or
            float16. Any strides; ``num_tokens`` may be 0.
        correction_bias: ``[num_experts]`` float32, bfloat16 or float16 (any of them, whatever
            the logits dtype: it is read as it is, never cast per call), or ``None``.
        num_expert_group: number of expert groups; must divide ``num_experts``.
        topk_group: groups kept per token, ``1 <= topk_group <= num_expert_group``.
        topk: experts chosen per token, at most ``topk_group * num_experts / num_expert_group``.
        renormalize: divide the chosen weights by their sum.
        routed_scaling_factor: multiplies every weight (after renormalisation).
        scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"``.

    Options (docs/SPEC.md §6; each absent by default, and then free):
        num_fused_shared_experts: ``S`` shared experts appended to every row: columns
            ``topk + j`` hold id ``num_experts + j`` and weight ``shared_expert_weight``
            (written as given: 1.0 where the routed weights carry the scaling factor; an
            engine that scales the MoE output instead passes ``1 / routed_scaling_factor``).
        expert_map: int32 ``[num_experts + S]``: every id written is ``expert_map[id]``
            (global to local for expert parallelism, -1 for an expert held elsewhere).
            Selection, order and ties are decided on the logical ids first.
        expert_counts: int32 or int64 ``[num_experts]``, added to in place: +1 per routed
            logical id of every counted row (never the shared ones). The caller zeroes it.
        routed_experts: int16 or int32 ``[R, topk]``, ``R >= num_tokens`` (a buffer sized for
            the largest batch): row t receives row t's routed logical ids in output order,
            before the map, without shared experts (a record to replay with
            :func:`routing_weights`). int16 needs ``num_experts <= 32767``.
        num_valid_tokens: int32 or int64, one element on the logits' device (a captured CUDA
            graph reads it at replay): rows at or past it are routed but neither counted nor
            recorded (a negative value counts none). Absent: every row counts.

    Returns:
        ``(topk_weights, topk_ids)``: ``[num_tokens, topk + S]`` float32 and int32, each row in
        descending ``b`` order (ties by lower id), then the shared experts.

    Gradients: where ``gating_output`` requires grad (and grad mode is on), ``topk_weights``
    is differentiable in the logits: the derivative of steps 1 and 5 at the chosen ids (of
    the whole row for softmax), as torch's autograd takes it through
    ``moeext.reference.biased_grouped_topk``, except that an expert outside the chosen ones
    gets 0 where the reference's whole-row derivative is NaN (a NaN logit). A sqrt-softplus
    score's derivative is finite at any logit, -inf included (docs/SPEC.md §1). The bias and
    the ids get no gradient. The ``_out`` form records no gradient.

    Raises:
        RuntimeError: naming the offending argument, for any input outside the contract
        (shape, dtype, device, topology, scoring function).
    """
    # TorchScript must not see the direct call, and Dynamo must trace the op. (Other tracers
    # pass fake tensors, which the direct call declines. Asking is_compiling() instead of
    # is_dynamo_compiling() cost 45 ns, and packing the arguments, spelled out twice here,
    # in one tuple 30 ns.)
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_biased_grouped_topk(
            gating_output,
            correction_bias,
            num_expert_group,
            topk_group,
            topk,
            renormalize,
            routed_scaling_factor,
            scoring_func,
            num_fused_shared_experts,
            shared_expert_weight,
            expert_map,
            expert_counts,
            routed_experts,
            num_valid_tokens,
        )
        if out is not NotImplemented:
            return out
        _check_tensors("biased_grouped_topk", gating_output=gating_output)
    return torch.ops.moeext.biased_grouped_topk(
        gating_output,
        correction_bias,
        num_expert_group,
        topk_group,
        topk,
        renormalize,
        routed_scaling_factor,
        scoring_func,
        num_fused_shared_experts,
        shared_expert_weight,
        expert_map,
        expert_counts,
        routed_experts,
        num_valid_tokens,
    )


def biased_grouped_topk_out(
    gating_output: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
) -> None:
    """In-place form of :func:`biased_grouped_topk` writing into preallocated outputs, with
    the same options.

    ``topk`` is ``topk_ids.size(1) - num_fused_shared_experts``. ``topk_weights`` (float32)
    and ``topk_ids`` (int32) are ``[num_tokens, topk + S]`` with contiguous columns and any
    row stride, e.g. the first columns of a wider persistent buffer: nothing outside the
    views is written. What the call writes (the outputs, ``expert_counts``,
    ``routed_experts``) must not share memory with what it reads, with each other or with
    itself (views side by side in one workspace are fine). On invalid arguments nothing is
    written at all.

    Records no gradient: in grad mode, a ``gating_output`` or ``topk_weights`` that requires
    grad raises RuntimeError before anything is written, as torch's ``out=`` ops raise (use
    :func:`biased_grouped_topk`, or ``torch.no_grad()``). Bumps the autograd version of both
    outputs, as torch's ``out=`` ops do, so a backward through a value it overwrote raises.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_biased_grouped_topk_out(
            gating_output,
            correction_bias,
            topk_weights,
            topk_ids,
            num_expert_group,
            topk_group,
            renormalize,
            routed_scaling_factor,
            scoring_func,
            num_fused_shared_experts,
            shared_expert_weight,
            expert_map,
            expert_counts,
            routed_experts,
            num_valid_tokens,
        )
        if out is not NotImplemented:
            return
        _check_tensors("biased_grouped_topk_out", gating_output=gating_output,
                       topk_weights=topk_weights, topk_ids=topk_ids)
    torch.ops.moeext.biased_grouped_topk_out(
        gating_output,
        correction_bias,
        topk_weights,
        topk_ids,
        num_expert_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        scoring_func,
        num_fused_shared_experts,
        shared_expert_weight,
        expert_map,
        expert_counts,
        routed_experts,
        num_valid_tokens,
    )


def routing_weights(
    gating_output: torch.Tensor,
    topk_ids: torch.Tensor,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> torch.Tensor:
    """The weights routing gives the experts ``topk_ids`` from these logits (docs/SPEC.md
    §6.6): replay of a recorded routing, with the gradient a trainer needs.

    Steps 6 and 7 of :func:`biased_grouped_topk` at given ids: the experts' scores ``s``
    (softmax over the whole row), NaN as 0, divided by their sum + 1e-20 if ``renormalize``,
    times ``routed_scaling_factor``. Given the ids routing chose, in its order, the weights
    are routing's own, bit for bit, on the same device (and CPU path); on a GPU, a softmax
    row routed with groups to keep can differ within the rounding of its sum (§6.6 says when).

    Args:
        gating_output: ``[num_tokens, num_experts]`` float32, bfloat16 or float16, any strides.
        topk_ids: ``[num_tokens, k]`` int16, int32 or int64 (a ``routed_experts`` record
            included), each row ``k`` distinct ids in ``[0, num_experts)``; any strides.
        renormalize, routed_scaling_factor, scoring_func: as in :func:`biased_grouped_topk`.

    Returns:
        float32 ``[num_tokens, k]``, in the ids' column order. Where ``gating_output``
        requires grad (in grad mode), differentiable in it, as :func:`biased_grouped_topk`'s
        weights are.

    Raises:
        RuntimeError: naming the argument, for a shape, dtype or device outside the contract,
        and on the CPU for an id out of range or repeated in its row (nothing is written).
        A GPU checks the ids where they are, without a host synchronisation (so a CUDA graph
        can capture the call): a row holding such an id gets NaN weights, and so a NaN loss.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_routing_weights(gating_output, topk_ids, renormalize, routed_scaling_factor,
                                    scoring_func)
        if out is not NotImplemented:
            return out
        _check_tensors("routing_weights", gating_output=gating_output, topk_ids=topk_ids)
    return torch.ops.moeext.routing_weights(gating_output, topk_ids, renormalize,
                                            routed_scaling_factor, scoring_func)


def router_gemm(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Router (gate) logits ``hidden_states @ weight.T`` with fp32 accumulation, docs/SPEC.md §2.

    The product a MoE gate computes, returned directly in fp32: no upcast of the inputs, no
    bf16 GEMM result to widen afterwards. On the CPU the weight streams from memory once per
    call (once per 224 to 256 tokens for bf16 batches of 5 or more on AVX512-BF16, and for a
    prepacked weight), in its ``nn.Linear`` layout or, faster for small batches, in the
    layout ``prepack_router_weight`` made of it once. The instruction set is chosen at run
    time (AVX512-BF16 dot products, AVX-512 or AVX2 FMAs on bf16 widened by shifting, or
    portable C++).
    On the AVX512-BF16 path bf16 denormals (magnitude below 2^-126) read as zero.

    Args:
        hidden_states: ``[num_tokens, hidden_size]`` bfloat16 (the fast path), float16 or
            float32. ``num_tokens`` may be 0; rows may be strided (a slice of a wider buffer)
            but each row must be contiguous.
        weight: ``[num_experts, hidden_size]``, the same dtype, contiguous rows (the gate's
            ``nn.Linear.weight`` as loaded); or, on the CPU with bfloat16 ``hidden_states``,
            the ``[ceil(hidden_size / 2), num_experts, 2]`` tensor ``prepack_router_weight``
            returned for it.
        out_dtype: ``None`` or ``torch.float32`` for fp32 logits; ``torch.bfloat16`` rounds
            the fp32 sums once (nearest even) for a router that reads bf16.

    Returns:
        ``[num_tokens, num_experts]`` logits in ``out_dtype`` (float32 by default).

    Gradients: where an input requires grad (and grad mode is on), the logits are
    differentiable: ``grad @ weight`` and ``grad.T @ hidden_states``, computed in fp32 and
    returned in the inputs' dtype. A prepacked weight has no gradient formula.

    Raises:
        RuntimeError: naming the offending argument, for a shape, dtype, device, stride or
        ``out_dtype`` outside the contract (a prepacked weight on a GPU included), or for a
        prepacked weight where a gradient is wanted.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_router_gemm(hidden_states, weight, out_dtype)
        if out is not NotImplemented:
            return out
        _check_tensors("router_gemm", hidden_states=hidden_states, weight=weight)
    return torch.ops.moeext.router_gemm(hidden_states, weight, out_dtype)


def fused_router(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
    return_logits: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The router GEMM and the routing in one call, docs/SPEC.md §7: exactly
    ``biased_grouped_topk(router_gemm(hidden_states, weight), correction_bias, ...)``.

    The fp32 logits are :func:`router_gemm`'s, bit for bit, and are routed as
    :func:`biased_grouped_topk` routes them, so ids and weights equal the two calls' on the
    same device. The logits stay inside the call unless ``return_logits``. On a CUDA device
    the two kernels run one after the other (a one-launch kernel for decode batches exists
    for A/B timing and measured slower, docs/SPEC.md §7). On the CPU the GEMM (the experts
    split over torch's threads) and then the routing run in one call.

    Args:
        hidden_states, weight: as for :func:`router_gemm` (a prepacked weight on the CPU).
        correction_bias, num_expert_group, topk_group, topk, renormalize,
        routed_scaling_factor, scoring_func: as for :func:`biased_grouped_topk`.
        num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
        routed_experts, num_valid_tokens: the options of docs/SPEC.md §6, as for
            :func:`biased_grouped_topk`.
        return_logits: also return the fp32 logits ``[num_tokens, num_experts]``.

    Returns:
        ``(topk_weights, topk_ids, logits)``: as :func:`biased_grouped_topk` returns them, and
        the logits, or ``None`` without ``return_logits``.

    Gradients: where ``hidden_states`` or ``weight`` requires grad (and grad mode is on), the
    call runs as the two ops, so that each records its gradient; the bits are the same.

    Raises:
        RuntimeError: naming the offending argument, with the two ops' own messages.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_fused_router(
            hidden_states,
            weight,
            correction_bias,
            num_expert_group,
            topk_group,
            topk,
            renormalize,
            routed_scaling_factor,
            scoring_func,
            num_fused_shared_experts,
            shared_expert_weight,
            expert_map,
            expert_counts,
            routed_experts,
            num_valid_tokens,
            return_logits,
        )
        if out is not NotImplemented:
            return out
        _check_tensors("fused_router", hidden_states=hidden_states, weight=weight)
    weights, ids, logits = torch.ops.moeext.fused_router(
        hidden_states,
        weight,
        correction_bias,
        num_expert_group,
        topk_group,
        topk,
        renormalize,
        routed_scaling_factor,
        scoring_func,
        num_fused_shared_experts,
        shared_expert_weight,
        expert_map,
        expert_counts,
        routed_experts,
        num_valid_tokens,
        return_logits,
    )
    return weights, ids, logits if return_logits else None


def fused_router_out(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
    num_fused_shared_experts: int = 0,
    shared_expert_weight: float = 1.0,
    expert_map: Optional[torch.Tensor] = None,
    expert_counts: Optional[torch.Tensor] = None,
    routed_experts: Optional[torch.Tensor] = None,
    num_valid_tokens: Optional[torch.Tensor] = None,
) -> None:
    """In-place form of :func:`fused_router` writing into preallocated outputs, with the same
    options: the router GEMM and the routing in one call, the logits kept inside.

    ``topk`` is ``topk_ids.size(1) - num_fused_shared_experts``. ``topk_weights`` (float32)
    and ``topk_ids`` (int32) are ``[num_tokens, topk + S]`` with contiguous columns and any
    row stride, as for :func:`biased_grouped_topk_out`; what they hold afterwards equals
    :func:`fused_router`'s results bit for bit. What the call writes (the outputs,
    ``expert_counts``, ``routed_experts``) must not share memory with what it reads
    (``hidden_states``, ``weight``, the bias, the options' inputs), with each other or with
    itself. On invalid arguments nothing is written at all.

    For decode loops that keep their routing buffers: on the CPU, making the two result
    tensors and their Python objects is most of what :func:`fused_router` costs beyond the
    GEMM at one token. There is no ``return_logits``: call :func:`fused_router` for them.

    Records no gradient: in grad mode, a ``hidden_states``, ``weight`` or ``topk_weights``
    that requires grad raises RuntimeError before anything is written. Bumps the autograd
    version of both outputs, as torch's ``out=`` ops do.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        out = _call_fused_router_out(
            hidden_states,
            weight,
            correction_bias,
            topk_weights,
            topk_ids,
            num_expert_group,
            topk_group,
            renormalize,
            routed_scaling_factor,
            scoring_func,
            num_fused_shared_experts,
            shared_expert_weight,
            expert_map,
            expert_counts,
            routed_experts,
            num_valid_tokens,
        )
        if out is not NotImplemented:
            return
        _check_tensors("fused_router_out", hidden_states=hidden_states, weight=weight,
                       topk_weights=topk_weights, topk_ids=topk_ids)
    torch.ops.moeext.fused_router_out(
        hidden_states,
        weight,
        correction_bias,
        topk_weights,
        topk_ids,
        num_expert_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        scoring_func,
        num_fused_shared_experts,
        shared_expert_weight,
        expert_map,
        expert_counts,
        routed_experts,
        num_valid_tokens,
    )


def prepack_router_weight(weight: torch.Tensor) -> torch.Tensor:
    """The router weight in the layout the CPU ``router_gemm`` reads fastest, made once.

    ``router_gemm`` accepts the result in place of ``weight``. The layout
    (``csrc/cpu/router_weight_pack.h`` describes it, and the same file writes it): experts in
    tiles of 64 (the last one narrower), each tile stored as ``[ceil(H / 2)][width][2]``, the
    bf16 pair ``(h = 2k, 2k + 1)`` of every expert of the tile for k = 0, 1, ... (an odd
    ``H``'s last pair padded with zero), the tiles one after the other. A register tile of the
    kernel then multiplies whole vectors of experts by one broadcast pair of each token, with
    the tokens in L1 and the weight in one sequential stream. On AMD Zen CPUs it pays for
    decode batches of up to about 8 tokens on AVX512-BF16, and for single tokens on AVX2; on
    an Intel Xeon (AVX512-BF16) it did not, and with a decode step's gates read in turn it
    took 1.2-1.8x the time of the ``nn.Linear`` layout (docs/PERFORMANCE.md).

    The result is opaque: its shape ``[ceil(H / 2), E, 2]`` carries the sizes, but it is no
    view of ``weight`` (``reference.unpack_router_weight`` inverts it). It is a copy: keep it
    instead of ``weight``, not beside it, and prepack again if the weight changes. It never
    requires grad: the layout has no gradient formula, so call it at load time, not per
    forward.

    Args:
        weight: ``[num_experts, hidden_size]`` bfloat16 CPU tensor (a gate's
            ``nn.Linear.weight``), any strides.

    Returns:
        A contiguous bfloat16 tensor ``[ceil(hidden_size / 2), num_experts, 2]``.

    Raises:
        ValueError: naming ``weight``, if it is not a 2-D bfloat16 CPU tensor (the CUDA
        ``router_gemm`` reads the ``nn.Linear`` layout directly).
    """
    op = "prepack_router_weight"
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [num_experts, hidden_size], got shape "
                         f"{list(weight.shape)}")
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"{op}: weight must be bfloat16 (the layout feeds bf16 dot products), "
                         f"got {weight.dtype}")
    if weight.device.type != "cpu":
        raise ValueError(f"{op}: the prepacked layout is read by the CPU kernels only; weight is "
                         f"on {weight.device} (pass it to router_gemm as it is)")
    # A tensor subclass (a Parameter is one) is read as the plain tensor it holds.
    return _C.prepack_router_weight(weight.detach().as_subclass(torch.Tensor))


def zero_tail_(buf: torch.Tensor, new_extent: int, prev_extent: int) -> None:
    """Zeroes rows ``[new_extent, prev_extent)`` of ``buf`` along dim 0, and nothing else.

    Replaces a full ``buf.fill_(0)`` of a persistent buffer whose readers only look below
    the current extent, as long as the buffer started zeroed: only the tail a previous,
    larger step left behind needs clearing. Extents beyond ``buf.size(0)`` are clamped; a
    no-op when ``prev_extent <= new_extent``.

    Args:
        buf: any dtype (1-byte and packed types included), at least 1-D, rows (dims 1..)
            contiguous, any stride along dim 0 that keeps rows apart (no broadcast rows).
        new_extent, prev_extent: row counts, >= 0 (a negative one raises RuntimeError).

    Autograd as for ``fill_``/``zero_``: it bumps ``buf``'s version, so a backward through a
    value it overwrote raises (inference tensors have no version and are written as they
    are); where ``buf`` requires grad in grad mode the zeroing is recorded, so the zeroed
    rows pass no gradient back, and a leaf that requires grad (or a view of one) raises
    RuntimeError before anything is written.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        if _call_zero_tail(buf, new_extent, prev_extent) is not NotImplemented:
            return
        _check_tensors("zero_tail_", buf=buf)
    torch.ops.moeext.zero_tail_(buf, new_extent, prev_extent)


def zero_tail_tracked_(buf: torch.Tensor, state: torch.Tensor, new_extent: int) -> None:
    """:func:`zero_tail_` with the previous extent kept in a tensor instead of a Python int.

    Reads the previous extent from ``state`` (one int64 on ``buf``'s device, outside
    ``buf``'s memory), zeroes rows ``[new_extent, previous)`` of ``buf`` and stores
    ``new_extent`` into ``state``. Because the previous extent is read from memory when the
    op runs, a captured CUDA graph replays correctly whatever batch ran before it. Start
    ``state`` at 0 with a zeroed buffer. A negative value found in ``state`` is read as 0 (a
    device cannot reject it without a host sync). Bumps the autograd versions of ``buf`` and
    ``state``, as :func:`zero_tail_`. Records no gradient: a ``buf`` that requires grad in
    grad mode raises RuntimeError before anything is written (a compiled backward could not
    be trusted with the previous extent; docs/SPEC.md §4 says why), so differentiate through
    :func:`zero_tail_` instead.
    """
    if not _is_scripting() and not _is_dynamo_compiling():
        if _call_zero_tail_tracked(buf, state, new_extent) is not NotImplemented:
            return
        _check_tensors("zero_tail_tracked_", buf=buf, state=state)
    torch.ops.moeext.zero_tail_tracked_(buf, state, new_extent)


def _layout_arg(op: str, layout: Tuple[int, int]) -> List[int]:
    # list() of an int or None would raise a TypeError that never names the argument.
    if not isinstance(layout, (tuple, list)):
        raise TypeError(f"{op}: layout must be a pair of ints (IN, IK), got {layout!r}")
    return list(layout)


def shuffle_weight(w: torch.Tensor, layout: Tuple[int, int] = (16, 16),
                   gate_up: bool = False) -> torch.Tensor:
    """Pre-shuffles a weight into the tile layout AITER's MoE kernels read (docs/SPEC.md §3).

    Bit-exact with AITER's ``shuffle_weight(w, layout)``. For every leading index, rows form
    bands of ``layout[0]`` (16) rows; inside a band the 16-byte chunks of each chunk column
    are emitted as one ``16 x 16``-byte tile, row by row (nibbles are never split)::

        out.flat[((n0 * (K / C) + kc) * 16 + n1) * C + j] = w[n0 * 16 + n1][kc * C + j]

    with ``C = 16 / element_size`` elements per chunk.

    Args:
        w: ``[..., N, K]`` of a 1- or 2-byte dtype (uint8, int8, fp8, float4_e2m1fn_x2,
            bfloat16, float16); any leading dims, any row/batch strides. ``N`` a multiple of
            ``layout[0]``, ``K`` (in elements of ``w``'s dtype) of ``2 * layout[1]``.
        layout: ``(IN, IK)`` as AITER names it. ``IK`` moves nothing; it enters only the
            checks: ``K`` a multiple of ``2 * IK``, and ``2 * IK`` a whole number of 16-byte
            chunks (a multiple of ``C``), without which AITER's reshape fails.
        gate_up: ``w`` is a fused ``[E, 2N, K]`` gate/up weight (gate rows first): its halves
            are first interleaved in 16-row blocks (``g0..g15, u0..u15, g16..``), as AITER's
            ``shuffle_weight_a16w4(w, 16, gate_up=True)`` does. Needs ``2N % 32 == 0``.

    Returns:
        A new contiguous tensor of ``w``'s shape and dtype. Where ``w`` requires grad (in
        grad mode) it is differentiable: the gradient goes back through the inverse move.
    """
    _check_tensors("shuffle_weight", w=w)
    return torch.ops.moeext.shuffle_weight(w, _layout_arg("shuffle_weight", layout), gate_up)


def unshuffle_weight(w: torch.Tensor, layout: Tuple[int, int] = (16, 16),
                     gate_up: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`shuffle_weight` with the same ``layout`` and ``gate_up``."""
    _check_tensors("unshuffle_weight", w=w)
    return torch.ops.moeext.unshuffle_weight(w, _layout_arg("unshuffle_weight", layout), gate_up)


def e8m0_shuffle(scale: torch.Tensor, gate_up: bool = False,
                 num_experts: Optional[int] = None) -> torch.Tensor:
    """Shuffles E8M0 block scales into AITER's layout (bit-exact with ``e8m0_shuffle``).

    ``scale [m, n]`` (uint8 or float8_e8m0fnu, any strides) is padded to
    ``[ceil(m / 256) * 256, ceil(n / 8) * 8]`` with 0x7F (scale 1.0; AITER leaves padding
    uninitialised), then every 32-row x 8-column group becomes one contiguous 256-byte
    block::

        out.flat[a*32*sn + d*256 + f*64 + c4*4 + e*2 + h] = padded[a*32 + h*16 + c4][d*8 + e*4 + f]

    ``gate_up=True`` first interleaves gate and up rows in 16-row blocks inside each expert's
    rows, as AITER's ``shuffle_scale_a16w4(s, num_experts, gate_up=True)``; it needs
    ``num_experts`` and ``m / num_experts`` a multiple of 32; without gate_up it is not
    read (AITER's ``shuffle_scale_a16w4`` takes the count either way). E8M0 codes are
    exponents: like integers, the result carries no gradient (it never requires grad).
    """
    if not _is_scripting():
        _check_tensors("e8m0_shuffle", scale=scale)
    return torch.ops.moeext.e8m0_shuffle(scale, gate_up, num_experts)


def e8m0_unshuffle(shuffled: torch.Tensor, m: int, n: int, gate_up: bool = False,
                   num_experts: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`e8m0_shuffle`: the original ``[m, n]`` scales, padding dropped."""
    if not _is_scripting():
        _check_tensors("e8m0_unshuffle", shuffled=shuffled)
    return torch.ops.moeext.e8m0_unshuffle(shuffled, m, n, gate_up, num_experts)


def build_info() -> dict:
    """What this build contains: backends, CPU instruction-set paths, torch version, and the
    host C++ compiler that built it (``"GNU 12.2.0"``, ``"Clang 14.0.6"``)."""
    return _C.build_info()


def cpu_isa() -> str:
    """The instruction-set path the CPU kernels use now (``"avx512bf16"``, ``"avx512"``,
    ``"avx2"`` or ``"portable"``, the compiler's generic vectors)."""
    return _C.cpu_isa()


def set_cpu_isa(isa: str) -> None:
    """Forces the CPU kernels onto ``"portable"``, ``"avx2"``, ``"avx512"`` or ``"avx512bf16"``;
    ``"auto"`` picks the best. (Only biased_grouped_topk and router_gemm have a copy per path;
    ``"avx512bf16"`` changes router_gemm alone and runs biased_grouped_topk's ``"avx512"``
    code. e8m0_shuffle has two paths: SSE2 on ``"portable"``, AVX2 on every other.
    zero_tail_ and shuffle_weight have one, the same on every path.)

    ``"scalar"``, the portable path's name before 2026-11-28, is accepted for
    ``"portable"``. The environment variable ``MOEEXT_CPU_ISA`` (the same names) picks the
    path when moeext is imported (unset or empty: the best); a name this build or this CPU
    lacks leaves the best path in place, with a warning. ``set_cpu_isa`` raises ValueError
    for it instead.

    Switch between calls: each chunk of a call's work reads the path when it starts, so a
    call that runs while another thread switches may mix the two paths' results (each chunk
    still correct, but the whole bit-equal to neither path's).
    """
    _C.set_cpu_isa(isa)


def programmatic_dependent_launch() -> bool:
    """Whether the GPU kernels of the decode path launch with programmatic dependent launch
    (PDL); see :func:`set_programmatic_dependent_launch`."""
    return _C.programmatic_dependent_launch()


def set_programmatic_dependent_launch(enabled: bool) -> bool:
    """Turns programmatic dependent launch (PDL) of moeext's decode-path GPU kernels on or
    off for the whole process; returns the previous setting.

    Off by default; the environment variable ``MOEEXT_ENABLE_PDL`` sets the initial value when
    moeext is imported (``1`` on, ``0`` or unset or empty off; any other value makes the import
    raise a ValueError naming the variable).

    When on, the kernels of ``biased_grouped_topk(_out)``, ``router_gemm``, ``fused_router``
    and ``routing_weights`` are launched with CUDA's programmatic stream serialization, as
    vLLM and FlashInfer launch theirs: a kernel may be scheduled while the kernel before it on
    the stream is still running, and it waits for that kernel's results before its first
    access to global memory. What overlaps is the launch latency between the two kernels;
    results are bit for bit those of a plain launch. It takes effect only on a CUDA device of
    compute capability 9.0 or newer that runs this build's sm_90+ code (``sm_90a`` and
    ``sm_100a`` in the default build; another device runs the sm_80 code with plain launches);
    on older GPUs, on ROCm and on the CPU the setting changes nothing. Other ops (the shuffles,
    ``zero_tail_``) and shapes that go to cuBLAS always launch plainly.

    The setting is read on the host each time an op launches a kernel, so a CUDA graph keeps
    the mode that was on while it was captured, whatever is set when it is replayed; to
    compare both modes, capture one graph in each. ``torch.compile`` sees the ops as opaque
    calls: their schemas and fakes are the same in both modes, and a compiled function
    launches in the mode set when it runs (or, under CUDA graphs, when it was captured).
    """
    if not isinstance(enabled, bool):
        raise TypeError("set_programmatic_dependent_launch: enabled must be a bool, got "
                        f"{type(enabled).__name__}")
    return _C.set_programmatic_dependent_launch(enabled)


def _programmatic_dependent_launch_from_environment(value: Optional[str]) -> bool:
    """The initial PDL setting from the value of ``MOEEXT_ENABLE_PDL`` (None when unset)."""
    # Empty counts as unset, as `MOEEXT_ENABLE_PDL= python ...` means; a typo fails loudly
    # at import rather than at the first op, which may run inside a graph capture.
    if value is None or value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"MOEEXT_ENABLE_PDL must be '1' (programmatic dependent launch on) or "
                     f"'0' (off, the default), got {value!r}")
