"""moeext's routing ops with the GPU kernels, run on the host (tests/gpu_emulation/).

Each function has the signature of moeext's own and does what the GPU binding does
(csrc/torch/ops/*.cpp, its Gpu paths): the same launcher, the same choice between the one-launch
fused kernel and the two kernels, and between the small-T GEMM kernel and the platform GEMM.
The arguments are first checked by the CPU op itself, on copies of every buffer it writes
(the CPU and GPU bindings share their checks), so a bad argument raises the op's own message
and nothing is written. Calls that need a gradient, calls with a prepacked weight (a CPU
layout the GPU binding refuses), and GEMMs the GPU binding hands to the platform's GEMM run the
CPU op instead and are not counted in ``launches``.
"""

import contextlib

import torch

import moeext

SCORING = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}


def route(module, logits, bias, kwargs):
    """The routing kernel alone on `logits` (no checks, no options): ``(weights, ids)``;
    kwargs as a preset's op_kwargs(). The outputs start as -7: a row the kernel leaves
    unwritten shows, where fresh memory could hold an earlier call's results."""
    weights = torch.full((logits.shape[0], kwargs["topk"]), -7.0)
    ids = torch.full((logits.shape[0], kwargs["topk"]), -7, dtype=torch.int32)
    module.routing(logits, bias, weights, ids, kwargs["num_expert_group"], kwargs["topk_group"],
                   kwargs["topk"], kwargs["renormalize"], kwargs["routed_scaling_factor"],
                   SCORING[kwargs["scoring_func"]], 0, 1.0, None, None, None, None)
    return weights, ids


def _copy(t):
    return None if t is None else t.clone()


@contextlib.contextmanager
def _restored(*tensors):
    """Runs the block, then puts back what it wrote into `tensors` (None entries skipped): the
    out= ops' checks run for real, on the caller's own buffers (their overlaps), and the
    emulated kernels write the results."""
    saved = [(t, t.clone()) for t in tensors if t is not None]
    try:
        yield
    finally:
        for t, s in saved:
            t.copy_(s)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _prepacked(weight):
    return weight.dim() == 3


def _contiguous_rows(t):
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


class EmulatedOps:
    """The ops of ``module`` (tests/gpu_emulation/prepare.py's load), counting kernel launches."""

    def __init__(self, module, real=moeext):
        self.module = module
        self.real = {name: getattr(real, name) for name in self.NAMES}
        self.launches = 0
        # The fused kernel's completion counter, kept across calls as a stream's is: one that
        # a launch left above zero would leave the next launch's tokens unrouted.
        self.counter = torch.zeros(1, dtype=torch.int32)

    NAMES = ("biased_grouped_topk", "biased_grouped_topk_out", "router_gemm", "fused_router",
             "fused_router_out", "routing_weights")

    # ---- routing -------------------------------------------------------------------------

    def _route(self, logits, bias, weights, ids, groups, topk_group, topk, renormalize, scale,
               scoring, shared, shared_weight, expert_map, counts, routed, valid):
        if logits.shape[0] == 0:
            return
        self.module.routing(logits, bias, weights, ids, groups, topk_group, topk, renormalize,
                            scale, SCORING[scoring], shared, shared_weight, expert_map, counts,
                            routed, valid)
        self.launches += 1

    def biased_grouped_topk(self, gating_output, correction_bias, num_expert_group, topk_group,
                            topk, renormalize=True, routed_scaling_factor=1.0,
                            scoring_func="sigmoid", num_fused_shared_experts=0,
                            shared_expert_weight=1.0, expert_map=None, expert_counts=None,
                            routed_experts=None, num_valid_tokens=None):
        args = (num_expert_group, topk_group, topk, renormalize, routed_scaling_factor,
                scoring_func, num_fused_shared_experts, shared_expert_weight, expert_map)
        if _needs_grad(gating_output):
            return self.real["biased_grouped_topk"](gating_output, correction_bias, *args,
                                                    expert_counts, routed_experts,
                                                    num_valid_tokens)
        expected = self.real["biased_grouped_topk"](gating_output, correction_bias, *args,
                                                    _copy(expert_counts), _copy(routed_experts),
                                                    num_valid_tokens)
        weights, ids = torch.empty_like(expected[0]), torch.empty_like(expected[1])
        self._route(gating_output, correction_bias, weights, ids, num_expert_group, topk_group,
                    topk, renormalize, routed_scaling_factor, scoring_func,
                    num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
                    routed_experts, num_valid_tokens)
        return weights, ids

    def biased_grouped_topk_out(self, gating_output, correction_bias, topk_weights, topk_ids,
                                num_expert_group, topk_group, renormalize=True,
                                routed_scaling_factor=1.0, scoring_func="sigmoid",
                                num_fused_shared_experts=0, shared_expert_weight=1.0,
                                expert_map=None, expert_counts=None, routed_experts=None,
                                num_valid_tokens=None):
        with _restored(topk_weights, topk_ids, expert_counts, routed_experts):
            self.real["biased_grouped_topk_out"](
                gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                topk_group, renormalize, routed_scaling_factor, scoring_func,
                num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
                routed_experts, num_valid_tokens)
        topk = topk_ids.shape[1] - num_fused_shared_experts
        self._route(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group,
                    topk_group, topk, renormalize, routed_scaling_factor, scoring_func,
                    num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
                    routed_experts, num_valid_tokens)

    # ---- router GEMM ---------------------------------------------------------------------

    def _gemm(self, hidden, weight, logits):
        """The GPU binding's GEMM: False where it hands the GEMM to the platform's."""
        if hidden.shape[1] == 0:
            logits.zero_()
            return True
        if self.module.router_gemm(_contiguous_rows(hidden), _contiguous_rows(weight), logits):
            self.launches += 1
            return True
        return False

    def router_gemm(self, hidden_states, weight, out_dtype=None):
        expected = self.real["router_gemm"](hidden_states, weight, out_dtype)
        if (_needs_grad(hidden_states, weight) or _prepacked(weight)
                or hidden_states.shape[0] == 0):
            return expected
        logits = torch.empty_like(expected)
        return logits if self._gemm(hidden_states, weight, logits) else expected

    # ---- fused router --------------------------------------------------------------------

    def _fused(self, hidden, weight, bias, weights, ids, logits, groups, topk_group, topk,
               renormalize, scale, scoring, shared, shared_weight, expert_map, counts, routed,
               valid):
        if hidden.shape[0] == 0:
            return
        hidden, weight = _contiguous_rows(hidden), _contiguous_rows(weight)
        if self.module.fused_router(hidden, weight, bias, weights, ids, logits, self.counter,
                                    groups, topk_group, topk, renormalize, scale,
                                    SCORING[scoring], shared, shared_weight, expert_map, counts,
                                    routed, valid):
            assert int(self.counter) == 0, (
                f"the fused kernel left its completion counter at {int(self.counter)}")
            self.launches += 1
            return
        if not self._gemm(hidden, weight, logits):
            logits.copy_(self.real["router_gemm"](hidden, weight))
        self._route(logits, bias, weights, ids, groups, topk_group, topk, renormalize, scale,
                    scoring, shared, shared_weight, expert_map, counts, routed, valid)

    def fused_router(self, hidden_states, weight, correction_bias, num_expert_group, topk_group,
                     topk, renormalize=True, routed_scaling_factor=1.0, scoring_func="sigmoid",
                     num_fused_shared_experts=0, shared_expert_weight=1.0, expert_map=None,
                     expert_counts=None, routed_experts=None, num_valid_tokens=None,
                     return_logits=False):
        args = (num_expert_group, topk_group, topk, renormalize, routed_scaling_factor,
                scoring_func, num_fused_shared_experts, shared_expert_weight, expert_map)
        if _needs_grad(hidden_states, weight) or _prepacked(weight):
            return self.real["fused_router"](hidden_states, weight, correction_bias, *args,
                                             expert_counts, routed_experts, num_valid_tokens,
                                             return_logits)
        expected = self.real["fused_router"](hidden_states, weight, correction_bias, *args,
                                             _copy(expert_counts), _copy(routed_experts),
                                             num_valid_tokens, True)
        weights, ids = torch.empty_like(expected[0]), torch.empty_like(expected[1])
        logits = torch.empty_like(expected[2])
        self._fused(hidden_states, weight, correction_bias, weights, ids, logits,
                    num_expert_group, topk_group, topk, renormalize, routed_scaling_factor,
                    scoring_func, num_fused_shared_experts, shared_expert_weight, expert_map,
                    expert_counts, routed_experts, num_valid_tokens)
        return weights, ids, logits if return_logits else None

    def fused_router_out(self, hidden_states, weight, correction_bias, topk_weights, topk_ids,
                         num_expert_group, topk_group, renormalize=True,
                         routed_scaling_factor=1.0, scoring_func="sigmoid",
                         num_fused_shared_experts=0, shared_expert_weight=1.0, expert_map=None,
                         expert_counts=None, routed_experts=None, num_valid_tokens=None):
        if _prepacked(weight):
            return self.real["fused_router_out"](
                hidden_states, weight, correction_bias, topk_weights, topk_ids, num_expert_group,
                topk_group, renormalize, routed_scaling_factor, scoring_func,
                num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
                routed_experts, num_valid_tokens)
        with _restored(topk_weights, topk_ids, expert_counts, routed_experts):
            self.real["fused_router_out"](
                hidden_states, weight, correction_bias, topk_weights, topk_ids, num_expert_group,
                topk_group, renormalize, routed_scaling_factor, scoring_func,
                num_fused_shared_experts, shared_expert_weight, expert_map, expert_counts,
                routed_experts, num_valid_tokens)
        topk = topk_ids.shape[1] - num_fused_shared_experts
        logits = torch.empty(hidden_states.shape[0], weight.shape[0])
        self._fused(hidden_states, weight, correction_bias, topk_weights, topk_ids, logits,
                    num_expert_group, topk_group, topk, renormalize, routed_scaling_factor,
                    scoring_func, num_fused_shared_experts, shared_expert_weight, expert_map,
                    expert_counts, routed_experts, num_valid_tokens)

    # ---- replay --------------------------------------------------------------------------

    def routing_weights(self, gating_output, topk_ids, renormalize=True,
                        routed_scaling_factor=1.0, scoring_func="sigmoid"):
        expected = self.real["routing_weights"](gating_output, topk_ids, renormalize,
                                                routed_scaling_factor, scoring_func)
        if _needs_grad(gating_output) or expected.numel() == 0:
            return expected
        weights = torch.empty_like(expected)
        self.module.routing_weights(gating_output, topk_ids, weights, renormalize,
                                    routed_scaling_factor, SCORING[scoring_func])
        self.launches += 1
        return weights
