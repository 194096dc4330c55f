"""Modules built from moeext ops."""

import math
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from .ops import biased_grouped_topk, prepack_router_weight, router_gemm
from .presets import PRESETS
from .reference import unpack_router_weight

__all__ = ["GroupedTopKRouter"]


def _config_get(config: Any, key: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


class GroupedTopKRouter(torch.nn.Module):
    """The gate of a DeepSeek-V3-style MoE layer: router GEMM, then biased grouped top-k.

    Holds ``weight`` ``[num_experts, hidden_size]`` and, for models routed with a correction
    bias, the buffer ``e_score_correction_bias`` ``[num_experts]``: the names a DeepSeek-V3,
    Kimi-K2 or GLM-4.5 Hugging Face checkpoint stores under ``...mlp.gate.``, so
    ``load_state_dict`` of a real gate works as is (the DeepSeek inference format's ``bias``
    loads too). The bias stays fp32 whatever ``.to(dtype)`` the model gets: the routing
    kernel reads its dtype, and rounding a bias of ~2 to bf16 changes the chosen experts.

    ``forward`` runs two ops and nothing else (no casts, no host synchronisation), so it
    traces under ``torch.compile(fullgraph=True)``. Differentiable with the ``nn.Linear``
    layout: ``topk_weights`` carries its gradient to ``weight`` and the hidden states (the
    bias and the ids get none, as in :func:`moeext.biased_grouped_topk`). A prepacked weight
    is a serving layout without a gradient formula: its parameter is created with
    ``requires_grad=False``, and hidden states that require grad raise RuntimeError.

    Args:
        hidden_size, num_experts: the gate's shape.
        num_expert_group, topk_group, top_k, routed_scaling_factor, scoring_func,
            renormalize: the routing, as in :func:`moeext.biased_grouped_topk`.
        has_bias: whether the model routes with ``e_score_correction_bias``.
        logits_dtype: dtype of the router logits: ``torch.float32`` (the default, exact
            sums) or ``torch.bfloat16`` (rounded once; saves the widening when a router
            reads bf16 logits anyway).
        dtype: dtype of ``weight`` (the checkpoint's: bf16), hence of the hidden states:
            bf16, fp16 or fp32, as ``router_gemm`` reads them.
        device: where the parameters live.
        prepack_weight: hold ``weight`` in the layout of :func:`moeext.prepack_router_weight`
            (bf16 on the CPU only), which ``router_gemm`` reads faster for decode batches of
            up to about 8 tokens (docs/PERFORMANCE.md). ``load_state_dict`` takes the
            checkpoint's ``[num_experts, hidden_size]`` weight and packs it once;
            ``state_dict`` gives that layout back, so checkpoints stay interchangeable with an
            unpacked router. The parameter itself is then ``[ceil(hidden_size / 2),
            num_experts, 2]``.

    Raises:
        ValueError: when built with settings the routing op would refuse at the first
            ``forward`` (its own message), a ``logits_dtype`` or ``dtype`` other than the
            ones above, or ``prepack_weight`` off the CPU or without bf16.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        num_expert_group: int = 1,
        topk_group: int = 1,
        top_k: int = 8,
        routed_scaling_factor: float = 1.0,
        scoring_func: str = "sigmoid",
        renormalize: bool = True,
        has_bias: bool = True,
        logits_dtype: torch.dtype = torch.float32,
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[Union[str, torch.device]] = None,
        prepack_weight: bool = False,
    ):
        super().__init__()
        if logits_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"GroupedTopKRouter: logits_dtype must be torch.float32 or "
                             f"torch.bfloat16, got {logits_dtype}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):  # router_gemm's
            raise ValueError(f"GroupedTopKRouter: dtype must be torch.bfloat16, torch.float16 "
                             f"or torch.float32, got {dtype}")
        try:  # the routing op's own checks, on no data: a bad setting fails here, not later
            torch.ops.moeext.biased_grouped_topk(
                torch.empty(0, num_experts, device="meta"), None, num_expert_group, topk_group,
                top_k, renormalize, routed_scaling_factor, scoring_func)
        except RuntimeError as e:
            raise ValueError(f"GroupedTopKRouter: {e}") from None
        if prepack_weight and (dtype != torch.bfloat16
                               or torch.device(device or "cpu").type != "cpu"):
            raise ValueError(f"GroupedTopKRouter: prepack_weight needs a bfloat16 weight on the "
                             f"CPU, got dtype {dtype} on {torch.device(device or 'cpu')}")
        self.prepack_weight = prepack_weight
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.top_k = top_k
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.scoring_func = scoring_func
        self.renormalize = renormalize
        self.logits_dtype = logits_dtype
        shape = ((hidden_size + 1) // 2, num_experts, 2) if prepack_weight else (num_experts,
                                                                                   hidden_size)
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                         requires_grad=not prepack_weight)
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if has_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.register_load_state_dict_pre_hook(_accept_deepseek_bias_name)
        if prepack_weight:
            self.register_load_state_dict_pre_hook(_prepack_loaded_weight)
            self.register_state_dict_post_hook(_unpack_saved_weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation; checkpoints overwrite it.
        if self.prepack_weight:
            weight = torch.empty(self.num_experts, self.hidden_size, dtype=self.weight.dtype)
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            with torch.no_grad():
                self.weight.copy_(prepack_router_weight(weight))
        else:
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.e_score_correction_bias is not None:
            torch.nn.init.zeros_(self.e_score_correction_bias)

    @classmethod
    def from_preset(cls, name: str, hidden_size: int, **kwargs: Any) -> "GroupedTopKRouter":
        """A router with the routing of ``moeext.presets.PRESETS[name]`` (e.g.
        ``"deepseek-v3"``); ``kwargs`` (dtype, device, logits_dtype, ...) go to the
        constructor."""
        p = PRESETS[name]
        return cls(hidden_size, p.num_experts, num_expert_group=p.num_expert_group,
                   topk_group=p.topk_group, top_k=p.topk,
                   routed_scaling_factor=p.routed_scaling_factor, scoring_func=p.scoring_func,
                   renormalize=p.renormalize, has_bias=p.has_bias, **kwargs)

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> "GroupedTopKRouter":
        """A router from a Hugging Face-style model config (a dict or a config object).

        Reads ``hidden_size``, ``n_routed_experts``, ``n_group``, ``topk_group``,
        ``num_experts_per_tok``, ``routed_scaling_factor``, ``norm_topk_prob``,
        ``scoring_func`` (default ``"sigmoid"``, as GLM-4.5's config leaves it out) and
        ``topk_method``: ``"noaux_tc"`` routes with the correction bias, the DeepSeek-V2
        methods (``"greedy"``, ``"group_limited_greedy"``) without. ``kwargs`` go to the
        constructor and override the config, ``hidden_size`` and ``num_experts`` included;
        a size neither gives raises ValueError.
        """
        sizes = {}
        for name, key in (("hidden_size", "hidden_size"), ("num_experts", "n_routed_experts")):
            sizes[name] = kwargs.pop(name, None)
            if sizes[name] is None:
                sizes[name] = _config_get(config, key, None)
            if sizes[name] is None:
                raise ValueError(f"GroupedTopKRouter.from_config: the config has no '{key}' "
                                 f"(or pass {name}=...)")
        topk_method = _config_get(config, "topk_method", "noaux_tc")
        params = dict(
            num_expert_group=_config_get(config, "n_group", None) or 1,
            topk_group=_config_get(config, "topk_group", None) or 1,
            top_k=_config_get(config, "num_experts_per_tok", 8),
            routed_scaling_factor=_config_get(config, "routed_scaling_factor", 1.0),
            scoring_func=_config_get(config, "scoring_func", "sigmoid"),
            renormalize=bool(_config_get(config, "norm_topk_prob", True)),
            has_bias=topk_method == "noaux_tc",
        )
        params.update(kwargs)
        return cls(sizes["hidden_size"], sizes["num_experts"], **params)

    def forward(
        self, hidden_states: torch.Tensor, return_logits: bool = False
    ) -> Union[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Routes every token.

        Args:
            hidden_states: ``[..., hidden_size]`` in ``weight``'s dtype; leading dimensions
                are flattened into tokens.
            return_logits: also return the ``[num_tokens, num_experts]`` logits
                (``logits_dtype``).

        Returns:
            ``(topk_weights, topk_ids)`` — float32 and int32 ``[num_tokens, top_k]`` — and
            the logits if asked.
        """
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = router_gemm(tokens, self.weight, self.logits_dtype)
        topk_weights, topk_ids = biased_grouped_topk(
            logits, self.e_score_correction_bias, self.num_expert_group, self.topk_group,
            self.top_k, self.renormalize, self.routed_scaling_factor, self.scoring_func)
        if return_logits:
            return topk_weights, topk_ids, logits
        return topk_weights, topk_ids

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .bfloat16() / .half() would cast every floating buffer: keep the bias
        # in its dtype and let it follow the device only.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if bias is not None and self.e_score_correction_bias.dtype != bias.dtype:
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device)
        return self

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
                f"num_expert_group={self.num_expert_group}, topk_group={self.topk_group}, "
                f"top_k={self.top_k}, routed_scaling_factor={self.routed_scaling_factor}, "
                f"scoring_func={self.scoring_func!r}, renormalize={self.renormalize}, "
                f"logits_dtype={self.logits_dtype}"
                + (", prepack_weight=True" if self.prepack_weight else ""))


def _accept_deepseek_bias_name(module, state_dict, prefix, *args):
    """DeepSeek's own inference format names the correction bias ``gate.bias``."""
    old, new = prefix + "bias", prefix + "e_score_correction_bias"
    if old in state_dict and new not in state_dict and module.e_score_correction_bias is not None:
        state_dict[new] = state_dict.pop(old)


def _prepack_loaded_weight(module, state_dict, prefix, *args):
    """A checkpoint's [num_experts, hidden_size] weight, packed once as it loads (cast to
    bf16 first, as copying it into the bf16 parameter would)."""
    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is not None and weight.dim() == 2:
        state_dict[key] = prepack_router_weight(weight.to(device="cpu", dtype=torch.bfloat16))


def _unpack_saved_weight(module, state_dict, prefix, *args):
    """state_dict() gives the checkpoint layout back."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = unpack_router_weight(state_dict[key], module.hidden_size)
