"""Routing configurations of public MoE models (docs/SPEC.md §1), by name.

Each preset gives the keyword arguments of :func:`moeext.biased_grouped_topk` beyond the
tensors, plus ``num_experts`` and whether the model has a correction bias.
"""

from typing import NamedTuple

__all__ = ["RoutingPreset", "PRESETS"]


class RoutingPreset(NamedTuple):
    num_experts: int
    num_expert_group: int
    topk_group: int
    topk: int
    routed_scaling_factor: float
    scoring_func: str
    renormalize: bool = True
    has_bias: bool = True

    def op_kwargs(self) -> dict:
        """Keyword arguments of moeext.biased_grouped_topk for this preset."""
        return dict(
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            topk=self.topk,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
            scoring_func=self.scoring_func,
        )


PRESETS = {
    "deepseek-v3": RoutingPreset(256, 8, 4, 8, 2.5, "sigmoid"),
    "kimi-k2": RoutingPreset(384, 1, 1, 8, 2.827, "sigmoid"),
    "glm-4.5": RoutingPreset(160, 1, 1, 8, 2.5, "sigmoid"),
    "deepseek-v4-flash": RoutingPreset(256, 1, 1, 6, 1.5, "sqrtsoftplus"),
    "deepseek-v4-pro": RoutingPreset(384, 1, 1, 6, 2.5, "sqrtsoftplus"),
    "nemotron-style": RoutingPreset(512, 1, 1, 22, 1.0, "sigmoid"),
    "deepseek-v2": RoutingPreset(160, 8, 3, 6, 16.0, "softmax", renormalize=False,
                                 has_bias=False),
}
