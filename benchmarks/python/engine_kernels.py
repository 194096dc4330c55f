"""The engines' own GPU kernels for routing and the router GEMM, called through their Python
packages, for bench_cuda.py to time next to moeext on the same inputs.

Used only where the package imports (nothing here imports an engine at module level):
  vllm        vllm._custom_ops.grouped_topk (DeepSeek-V3 grouped top-k, fp32 weights) and
              vllm._custom_ops.dsv3_router_gemm (bf16 x bf16 -> fp32, H = 7168 or 6144,
              E = 256 or 384, 1 to 16 tokens)
  flashinfer  flashinfer.fused_moe.fused_topk_deepseek (TensorRT-LLM's NoAuxTc), with and
              without programmatic dependent launch (PDL)
  sgl_kernel  sgl_kernel.moe_fused_gate (power-of-2 expert counts, bias in the logits' dtype)

Each kernel comes as a ``Kernel``: a label, a callable that runs one call the way the engine
calls it (outputs allocated per call where the engine's API allocates or its callers do), or,
where the kernel does not take the case, the reason, and its launch mode where the caller sets
it (FlashInfer's ``launch_with_pdl``). The engines' sources were read at the
commits named next to each call; a signature that has moved on since makes that kernel skip
with a reason rather than be called wrongly.
"""

import inspect
from typing import Callable, NamedTuple, Optional

import torch

# Routing checks compare weights with these tolerances: the engines that keep scores in the
# logits' dtype (bf16) are within about 2e-3 of moeext's fp32 path.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-2, 1e-3
# Router logits: two fp32 accumulations of the same bf16 products, in different orders.
LOGIT_RTOL, LOGIT_ATOL = 1e-3, 1e-3


class Kernel(NamedTuple):
    label: str
    fn: Optional[Callable]  # one call; None when the kernel does not take the case
    skip: str = ""          # why it does not
    # Whether it launches with programmatic dependent launch (PDL) as called here; None where
    # its engine decides and its Python API cannot switch it (bench_cuda then compares it
    # with moeext in both modes).
    pdl: Optional[bool] = None


def _takes(fn, name):
    """Whether ``fn`` accepts the argument ``name`` (assumed so when its signature is hidden)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _import(what):
    try:
        if what == "vllm":
            from vllm import _custom_ops
            return _custom_ops, ""
        if what == "flashinfer":
            from flashinfer.fused_moe import fused_topk_deepseek
            return fused_topk_deepseek, ""
        import sgl_kernel
        return sgl_kernel, ""
    except Exception as exc:  # noqa: BLE001 -- an engine that fails to import for any reason
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _noauxtc_limit(preset):
    """Why FlashInfer's NoAuxTc does not take the preset, '' if it does: the checks of
    flashinfer/fused_moe/fused_routing_dsv3.py and invokeNoAuxTc @ fb28d724."""
    experts, groups = preset.num_experts, preset.num_expert_group
    if not preset.renormalize:
        return "NoAuxTc always renormalizes"
    if preset.topk > 8:
        return f"NoAuxTc takes topk <= 8, not {preset.topk}"
    if groups == 1:
        return "" if experts <= 384 else f"NoAuxTc takes <= 384 ungrouped experts, not {experts}"
    if experts > 256 or experts // groups > 32 or experts // groups * preset.topk_group > 128:
        return "NoAuxTc takes <= 256 experts, <= 32 a group and <= 128 in the kept groups"
    return ""


def _moe_fused_gate_limit(preset, sgl):
    """Why sgl_kernel.moe_fused_gate does not take the preset, '' if it does: the TORCH_CHECKs
    of sgl-kernel/csrc/moe/moe_fused_gate.cu, and the keyword this caller needs."""
    experts = preset.num_experts
    if not hasattr(sgl, "moe_fused_gate"):
        return "this sgl_kernel has no moe_fused_gate"
    if not _takes(sgl.moe_fused_gate, "apply_routed_scaling_factor_on_output"):
        return "this sgl_kernel's moe_fused_gate has no apply_routed_scaling_factor_on_output"
    if not preset.renormalize:
        return "moe_fused_gate always renormalizes"
    if experts & (experts - 1):
        return f"moe_fused_gate takes power-of-2 expert counts, not {experts}"
    per_group = experts // preset.num_expert_group
    if per_group > 32:
        return f"moe_fused_gate takes <= 32 experts a group, not {per_group}"
    return ""


class Engines:
    """The engine packages this Python can import, and their kernels for a given case."""

    PACKAGES = ("vllm", "flashinfer", "sgl_kernel")

    def __init__(self):
        self.modules, self.missing = {}, {}
        for name in self.PACKAGES:
            module, why = _import(name)
            if module is None:
                self.missing[name] = why
            else:
                self.modules[name] = module

    def header_lines(self):
        lines = [f"# {name}: not importable ({why}), no rows"
                 for name, why in self.missing.items()]
        if self.modules:
            lines.append("# engine kernels timed from: " + ", ".join(self.modules))
        return lines

    def routing(self, preset, bias, logits_dtype):
        """Kernels for moeext.biased_grouped_topk's case: fn(logits) -> (weights, ids)."""
        n_group, topk_group, topk = preset.num_expert_group, preset.topk_group, preset.topk
        scale = preset.routed_scaling_factor
        unsupported = ""
        if preset.scoring_func != "sigmoid" or bias is None:
            unsupported = ("the fused kernels take sigmoid scores with a correction bias, "
                           f"not {preset.scoring_func}" + (" without one" if bias is None else ""))
        kernels = []

        ops = self.modules.get("vllm")
        if ops is not None:
            label = "vllm grouped_topk"
            if not unsupported and not _takes(ops.grouped_topk, "scoring_func"):
                unsupported = ("this vllm's grouped_topk has the older "
                               "(scores, scores_with_bias, ...) signature")
            if unsupported:
                kernels.append(Kernel(label, None, unsupported))
            else:
                # vllm/_custom_ops.py @ 0002bde5: grouped_topk(scores, num_expert_group,
                # topk_group, topk, renormalize, routed_scaling_factor, bias, scoring_func);
                # 1 = sigmoid; allocates fp32 weights and int32 ids; any bias dtype; its own
                # limits are host-side checks (csrc/libtorch_stable/moe/grouped_topk_kernels.cu).
                def vllm_route(x):
                    return ops.grouped_topk(x, n_group, topk_group, topk, preset.renormalize,
                                            scale, bias, 1)
                kernels.append(Kernel(label, vllm_route))

        fused_topk_deepseek = self.modules.get("flashinfer")
        if fused_topk_deepseek is not None:
            why = unsupported or _noauxtc_limit(preset)
            for pdl in (True, False):
                label = "flashinfer NoAuxTc " + ("pdl" if pdl else "no-pdl")
                if why:
                    kernels.append(Kernel(label, None, why))
                    continue

                # flashinfer/fused_moe/fused_routing_dsv3.py @ fb28d724:
                # fused_topk_deepseek(scores, bias, n_group, topk_group, topk,
                # routed_scaling_factor, topk_values, topk_indices, launch_with_pdl=True)
                # writes into preallocated outputs (weights in the scores' dtype, int32 ids),
                # allocated here per call as moeext and the other engines allocate theirs.
                # The bias dtype is dispatched on its own (csrc/fused_moe/noAuxTcKernels.cu).
                def fi_route(x, pdl=pdl):
                    w = torch.empty(x.shape[0], topk, dtype=x.dtype, device=x.device)
                    ids = torch.empty(x.shape[0], topk, dtype=torch.int32, device=x.device)
                    fused_topk_deepseek(x, bias, n_group, topk_group, topk, scale, w, ids,
                                        launch_with_pdl=pdl)
                    return w, ids
                kernels.append(Kernel(label, fi_route, pdl=pdl))

        sgl = self.modules.get("sgl_kernel")
        if sgl is not None:
            label = "sglang moe_fused_gate"
            why = unsupported or _moe_fused_gate_limit(preset, sgl)
            if why:
                kernels.append(Kernel(label, None, why))
            else:
                # The kernel reads the bias as the logits' dtype: cast once here, untimed, as
                # SGLang keeps its correction bias. sgl-kernel/python/sgl_kernel/moe.py
                # @ 0c1e18c1: moe_fused_gate(input_tensor, bias, num_expert_group, topk_group,
                # topk, num_fused_shared_experts, routed_scaling_factor,
                # apply_routed_scaling_factor_on_output) -> [fp32 weights, int32 ids].
                bias_as_logits = bias.to(logits_dtype)

                def sgl_route(x):
                    w, ids = sgl.moe_fused_gate(x, bias_as_logits, n_group, topk_group, topk,
                                                num_fused_shared_experts=0,
                                                routed_scaling_factor=scale,
                                                apply_routed_scaling_factor_on_output=True)
                    return w, ids
                kernels.append(Kernel(label, sgl_route))
        return kernels

    def router_gemm(self, num_experts, hidden, num_tokens):
        """Kernels for moeext.router_gemm's fp32 case: fn(x, w) -> fp32 logits [T, E]."""
        ops = self.modules.get("vllm")
        if ops is None:
            return []
        label = "vllm dsv3_router_gemm"
        if not hasattr(ops, "dsv3_router_gemm") or not _takes(ops.dsv3_router_gemm,
                                                              "output_dtype"):
            return [Kernel(label, None, "this vllm's _custom_ops has no "
                                        "dsv3_router_gemm(hidden_states, router_weight, "
                                        "output_dtype)")]
        # Shapes: csrc/libtorch_stable/moe/dsv3_router_gemm_entry.cu (the shapes compiled in).
        if (hidden, num_experts) not in ((7168, 256), (7168, 384), (6144, 256)):
            return [Kernel(label, None, "dsv3_router_gemm takes H = 7168 with E = 256 or 384, "
                                        "or H = 6144 with E = 256")]
        if not 1 <= num_tokens <= 16:
            return [Kernel(label, None, "dsv3_router_gemm takes 1 to 16 tokens")]

        # vllm/_custom_ops.py, in the releases that have it (it is gone by 0002bde5, whose
        # GateLinear runs a cuteDSL GEMM): dsv3_router_gemm(hidden_states, router_weight,
        # output_dtype) allocates the output; router_weight is [E, H], as GateLinear.forward
        # (vllm/model_executor/layers/fused_moe/router/gate_linear.py) passes it.
        def vllm_gemm(x, w):
            return ops.dsv3_router_gemm(hidden_states=x, router_weight=w,
                                        output_dtype=torch.float32)
        return [Kernel(label, vllm_gemm)]

    def fused_pair(self, preset, bias, hidden, num_tokens):
        """The best engine pair for moeext.fused_router's case, run back to back: vLLM's router
        GEMM, then FlashInfer's routing (PDL on, its default) or else vLLM's.
        fn(x, w) -> (weights, ids)."""
        gemm = self.router_gemm(preset.num_experts, hidden, num_tokens)
        routes = [k for k in self.routing(preset, bias, torch.float32)
                  if k.label in ("flashinfer NoAuxTc pdl", "vllm grouped_topk")]
        routes.sort(key=lambda k: (k.fn is None, k.label != "flashinfer NoAuxTc pdl"))
        if not gemm or not routes:
            return []
        label = f"{gemm[0].label} + {routes[0].label}"
        if gemm[0].fn is None or routes[0].fn is None:
            return [Kernel(label, None, gemm[0].skip or routes[0].skip)]
        run_gemm, route = gemm[0].fn, routes[0].fn
        return [Kernel(label, lambda x, w: route(run_gemm(x, w)))]


def routing_mismatch(ours, theirs):
    """'' when the engine's (weights, ids) route as moeext's do: the same expert set in every
    row (the engines order a row's ids differently) and, over those rows, the weights matched
    by id within WEIGHT_RTOL / WEIGHT_ATOL. Otherwise, what differs."""
    our_w, our_ids = ours
    their_w, their_ids = theirs
    our_sorted, our_order = our_ids.long().sort(dim=1)
    their_sorted, their_order = their_ids.long().sort(dim=1)
    same = (our_sorted == their_sorted).all(dim=1)
    problems = []
    if not bool(same.all()):
        problems.append(f"expert sets differ in {int((~same).sum())} of {len(same)} rows")
    a = our_w.float().gather(1, our_order)[same]
    b = their_w.float().gather(1, their_order)[same]
    if a.numel() and not torch.allclose(b, a, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
        problems.append(f"weights differ by up to {float((b - a).abs().max()):.3g}")
    return "; ".join(problems)


def logits_mismatch(ours, theirs):
    """'' when the engine's router logits are moeext's within LOGIT_RTOL / LOGIT_ATOL."""
    if theirs.shape != ours.shape:
        return f"shape {tuple(theirs.shape)}, not {tuple(ours.shape)}"
    if torch.allclose(theirs.float(), ours, rtol=LOGIT_RTOL, atol=LOGIT_ATOL):
        return ""
    return f"logits differ by up to {float((theirs.float() - ours).abs().max()):.3g}"
