"""Modules built from moeext ops."""

import math
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch

from .ops import (biased_grouped_topk, fused_router, prepack_router_weight, router_gemm,
                  routing_weights)
from .presets import PRESETS
from .reference import unpack_router_weight

__all__ = ["GroupedTopKRouter", "expert_parallel_map", "update_correction_bias_"]


def expert_parallel_map(
    num_experts: int,
    ep_rank: int,
    ep_size: int,
    placement: Union[str, Sequence[int], torch.Tensor] = "linear",
    num_fused_shared_experts: int = 0,
    device: Optional[Union[str, torch.device]] = None,
) -> torch.Tensor:
    """The expert map of one expert-parallel rank, for the routing ops' ``expert_map``.

    int32 ``[num_experts + num_fused_shared_experts]``: the local id (0, 1, ... in global
    order) of every routed expert this rank holds, -1 for the others; the fused shared experts
    are held by every rank, after its routed ones.

    Args:
        placement: which rank holds each routed expert: ``"linear"`` (contiguous blocks, the
            first ``num_experts % ep_size`` ranks one expert more, as vLLM places them),
            ``"round_robin"`` (expert e on rank ``e % ep_size``), or a sequence of
            ``num_experts`` ranks (an EPLB placement).

    Raises:
        ValueError: naming the argument, for a rank outside ``[0, ep_size)``, a placement of
        the wrong length or naming such a rank, or an unknown placement name.
    """
    name = "expert_parallel_map"
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"{name}: ep_rank must be in [0, ep_size) with ep_size >= 1, got "
                         f"ep_rank {ep_rank} and ep_size {ep_size}")
    if num_fused_shared_experts < 0:
        raise ValueError(f"{name}: num_fused_shared_experts must be >= 0, got "
                         f"{num_fused_shared_experts}")
    experts = torch.arange(num_experts)
    if isinstance(placement, str):
        if placement == "linear":
            base, extra = divmod(num_experts, ep_size)
            first_of = [r * base + min(r, extra) for r in range(ep_size + 1)]
            owner = torch.bucketize(experts, torch.tensor(first_of[1:]), right=True)
        elif placement == "round_robin":
            owner = experts % ep_size
        else:
            raise ValueError(f"{name}: placement must be 'linear', 'round_robin' or a sequence "
                             f"of ranks, got {placement!r}")
    else:
        owner = torch.as_tensor(placement, dtype=torch.int64).reshape(-1)
        if owner.numel() != num_experts or bool(((owner < 0) | (owner >= ep_size)).any()):
            raise ValueError(f"{name}: placement must give each of the {num_experts} experts a "
                             f"rank in [0, {ep_size})")
    mine = owner == ep_rank
    local = torch.full((num_experts + num_fused_shared_experts,), -1, dtype=torch.int32)
    held = int(mine.sum())
    local[:num_experts][mine] = torch.arange(held, dtype=torch.int32)
    local[num_experts:] = torch.arange(held, held + num_fused_shared_experts, dtype=torch.int32)
    return local.to(device)


@torch.no_grad()
def update_correction_bias_(correction_bias: torch.Tensor, expert_counts: torch.Tensor,
                            step: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: each expert's bias moves by
    ``step`` towards balance, down where the expert took more tokens than the mean, up where
    it took fewer, unchanged where it took exactly the mean. Returns ``correction_bias``.

    Args:
        correction_bias: ``[num_experts]`` (fp32, as ``GroupedTopKRouter`` keeps it).
        expert_counts: ``[num_experts]`` tokens per expert since the last update (the routing
            ops' ``expert_counts``); the caller zeroes it for the next period.
        step: the update speed (DeepSeek-V3's gamma: 0.001 for most of its training).
    """
    if expert_counts.shape != correction_bias.shape:
        raise ValueError(f"update_correction_bias_: expert_counts must have the shape of "
                         f"correction_bias {list(correction_bias.shape)}, got "
                         f"{list(expert_counts.shape)}")
    counts = expert_counts.to(device=correction_bias.device, dtype=torch.float64)
    direction = torch.sign(counts.mean() - counts).to(correction_bias.dtype)
    return correction_bias.add_(direction, alpha=step)


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

    ``forward`` runs one op, :func:`moeext.fused_router` (with bf16 ``logits_dtype`` the two
    it fuses), and nothing else (no casts, no host synchronisation), so it traces under
    ``torch.compile(fullgraph=True)``. Differentiable with the ``nn.Linear``
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
            up to about 8 tokens on AMD Zen CPUs, and slower on an Intel Xeon
            (docs/PERFORMANCE.md). ``load_state_dict`` takes the
            checkpoint's ``[num_experts, hidden_size]`` weight and packs it once;
            ``state_dict`` gives that layout back, so checkpoints stay interchangeable with an
            unpacked router. The parameter itself is then ``[ceil(hidden_size / 2),
            num_experts, 2]``.

        num_fused_shared_experts, shared_expert_weight: the shared experts appended to every
            token's choice (docs/SPEC.md §6.1); ``from_config(..., fuse_shared_experts=True)``
            takes their number from the config's ``n_shared_experts``.
        expert_map: this rank's expert map for expert parallelism (see
            :func:`expert_parallel_map`), or None; :meth:`set_expert_map` changes it.

    For engines and trainers, beside ``forward``: :meth:`track_expert_counts` keeps the
    tokens each expert takes (EPLB, :func:`update_correction_bias_`), :meth:`record_routing`
    records each step's routed ids, and :meth:`replay` gives the weights of given ids with
    their gradient.

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
        num_fused_shared_experts: int = 0,
        shared_expert_weight: float = 1.0,
        expert_map: Optional[torch.Tensor] = None,
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
                top_k, renormalize, routed_scaling_factor, scoring_func,
                num_fused_shared_experts, shared_expert_weight)
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
        self.num_fused_shared_experts = num_fused_shared_experts
        self.shared_expert_weight = float(shared_expert_weight)
        shape = ((hidden_size + 1) // 2, num_experts, 2) if prepack_weight else (num_experts,
                                                                                   hidden_size)
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                         requires_grad=not prepack_weight)
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if has_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        # Engine state, not checkpoint state: kept out of state_dict.
        self.register_buffer("expert_map", None, persistent=False)
        self.register_buffer("expert_counts", None, persistent=False)
        self.register_buffer("routed_experts", None, persistent=False)
        if expert_map is not None:
            self.set_expert_map(expert_map)
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

        ``fuse_shared_experts=True`` appends the config's ``n_shared_experts`` shared experts
        to every token's choice.

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
        fuse_shared_experts = kwargs.pop("fuse_shared_experts", False)
        if fuse_shared_experts and "num_fused_shared_experts" not in kwargs:
            kwargs["num_fused_shared_experts"] = _config_get(config, "n_shared_experts", 0) or 0
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
        self, hidden_states: torch.Tensor, return_logits: bool = False,
        num_valid_tokens: Optional[torch.Tensor] = None,
    ) -> Union[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Routes every token.

        Args:
            hidden_states: ``[..., hidden_size]`` in ``weight``'s dtype; leading dimensions
                are flattened into tokens.
            return_logits: also return the ``[num_tokens, num_experts]`` logits
                (``logits_dtype``).
            num_valid_tokens: rows at or past this one-element tensor's value (padding of a
                captured batch) are neither counted nor recorded.

        Returns:
            ``(topk_weights, topk_ids)`` — float32 and int32 ``[num_tokens, top_k + S]`` with
            the S fused shared experts last, ids through the expert map if one is set — and
            the logits if asked.
        """
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.logits_dtype != torch.float32:
            # bf16 logits are the GEMM's rounded once; the fused router routes fp32 ones.
            logits = router_gemm(tokens, self.weight, self.logits_dtype)
            topk_weights, topk_ids = biased_grouped_topk(
                logits, self.e_score_correction_bias, self.num_expert_group, self.topk_group,
                self.top_k, self.renormalize, self.routed_scaling_factor, self.scoring_func,
                self.num_fused_shared_experts, self.shared_expert_weight, self.expert_map,
                self.expert_counts, self.routed_experts, num_valid_tokens)
        else:
            topk_weights, topk_ids, logits = fused_router(
                tokens, self.weight, self.e_score_correction_bias, self.num_expert_group,
                self.topk_group, self.top_k, self.renormalize, self.routed_scaling_factor,
                self.scoring_func, self.num_fused_shared_experts, self.shared_expert_weight,
                self.expert_map, self.expert_counts, self.routed_experts, num_valid_tokens,
                return_logits)
        if return_logits:
            return topk_weights, topk_ids, logits
        return topk_weights, topk_ids

    def replay(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The weights of given routed experts (a recorded routing), with their gradient to
        ``weight`` and ``hidden_states``: :func:`moeext.routing_weights` of this gate's logits.

        Args:
            hidden_states: ``[..., hidden_size]``, flattened into tokens as in ``forward``.
            topk_ids: ``[num_tokens, k]`` logical ids (a :meth:`record_routing` record, or
                ``forward``'s ids without an expert map and shared experts).

        Returns:
            float32 ``[num_tokens, k]``.
        """
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = router_gemm(tokens, self.weight, self.logits_dtype)
        return routing_weights(logits, topk_ids, self.renormalize, self.routed_scaling_factor,
                               self.scoring_func)

    def set_expert_map(self, expert_map: Optional[torch.Tensor]) -> None:
        """Sets (or, with None, clears) the expert map ``forward`` writes ids through: int32
        ``[num_experts + num_fused_shared_experts]``, e.g. :func:`expert_parallel_map`'s."""
        if expert_map is not None:
            size = self.num_experts + self.num_fused_shared_experts
            if expert_map.shape != (size,):
                raise ValueError(f"GroupedTopKRouter.set_expert_map: expert_map must have shape "
                                 f"[{size}], got {list(expert_map.shape)}")
            expert_map = expert_map.to(device=self.weight.device, dtype=torch.int32)
        self.expert_map = expert_map

    def track_expert_counts(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Starts counting the tokens each routed expert takes (``forward`` adds to the
        buffer ``expert_counts``, ``[num_experts]``); returns the buffer."""
        self.expert_counts = torch.zeros(self.num_experts, dtype=dtype,
                                         device=self.weight.device)
        return self.expert_counts

    def reset_expert_counts(self) -> torch.Tensor:
        """The counts since the last reset (a copy), the buffer zeroed for the next period."""
        if self.expert_counts is None:
            raise RuntimeError("GroupedTopKRouter.reset_expert_counts: counts are not tracked "
                               "(call track_expert_counts first)")
        counts = self.expert_counts.clone()
        self.expert_counts.zero_()
        return counts

    def update_correction_bias_(self, step: float, reset: bool = True) -> torch.Tensor:
        """:func:`update_correction_bias_` of this gate's bias from its counts (zeroed after,
        unless ``reset=False``); returns the bias."""
        if self.e_score_correction_bias is None:
            raise RuntimeError("GroupedTopKRouter.update_correction_bias_: this router has no "
                               "correction bias")
        counts = self.reset_expert_counts() if reset else self.expert_counts
        if counts is None:
            raise RuntimeError("GroupedTopKRouter.update_correction_bias_: counts are not "
                               "tracked (call track_expert_counts first)")
        return update_correction_bias_(self.e_score_correction_bias, counts, step)

    def record_routing(self, max_tokens: Optional[int],
                       dtype: torch.dtype = torch.int16) -> Optional[torch.Tensor]:
        """Starts recording (``max_tokens``: the largest batch) or, with None, stops: each
        ``forward`` writes its rows' routed logical ids, in order and before the expert map,
        into rows ``[0, num_tokens)`` of the buffer ``routed_experts`` ``[max_tokens, top_k]``
        (int16 while ``num_experts <= 32767``), which :meth:`replay` takes back. Returns it."""
        self.routed_experts = None if max_tokens is None else torch.zeros(
            max_tokens, self.top_k, dtype=dtype, device=self.weight.device)
        return self.routed_experts

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
                + (", prepack_weight=True" if self.prepack_weight else "")
                + (f", num_fused_shared_experts={self.num_fused_shared_experts}"
                   if self.num_fused_shared_experts else ""))


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
