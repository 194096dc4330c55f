"""moeext.nn.GroupedTopKRouter: checkpoint loading, dtypes, routing, torch.compile."""

import types

import pytest
import torch

import moeext
from moeext import reference
from moeext.nn import GroupedTopKRouter
from moeext.presets import PRESETS
from routing_check import assert_routing_matches

# The routing part of the public config.json files (Hugging Face format).
DEEPSEEK_V3_CONFIG = dict(hidden_size=7168, n_routed_experts=256, n_group=8, topk_group=4,
                          num_experts_per_tok=8, routed_scaling_factor=2.5, norm_topk_prob=True,
                          scoring_func="sigmoid", topk_method="noaux_tc")
KIMI_K2_CONFIG = dict(hidden_size=7168, n_routed_experts=384, n_group=1, topk_group=1,
                      num_experts_per_tok=8, routed_scaling_factor=2.827, norm_topk_prob=True,
                      scoring_func="sigmoid", topk_method="noaux_tc")
GLM_45_CONFIG = dict(hidden_size=5120, n_routed_experts=160, n_group=1, topk_group=1,
                     num_experts_per_tok=8, routed_scaling_factor=2.5, norm_topk_prob=True)
DEEPSEEK_V2_CONFIG = dict(hidden_size=5120, n_routed_experts=160, n_group=8, topk_group=3,
                          num_experts_per_tok=6, routed_scaling_factor=16.0,
                          norm_topk_prob=False, scoring_func="softmax",
                          topk_method="group_limited_greedy")


def deepseek_v3_gate_state_dict(layer=3, seed=0):
    """A gate as the DeepSeek-V3 checkpoint stores it: bf16 weight, fp32 bias around +2."""
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{layer}.mlp.gate."
    return {
        prefix + "weight": (0.02 * torch.randn(256, 7168, generator=g)).bfloat16(),
        prefix + "e_score_correction_bias": 2.05 + 0.03 * torch.randn(256, generator=g),
    }


class MoEBlock(torch.nn.Module):
    """Just enough of a decoder layer for the checkpoint's key names to line up."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate


def model_with_gate(router, layer=3):
    """The module tree whose state-dict keys are the checkpoint's: model.layers.N.mlp.gate."""
    return torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"layers": torch.nn.ModuleDict(
        {str(layer): torch.nn.ModuleDict({"mlp": MoEBlock(router)})})})})


def test_loads_a_deepseek_v3_gate_and_routes_like_the_reference(device):
    state = deepseek_v3_gate_state_dict()  # on the CPU, as a checkpoint loads
    router = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG, device=device)
    model = model_with_gate(router)
    model.load_state_dict(state, strict=True)
    weight = state["model.layers.3.mlp.gate.weight"]
    bias = state["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert router.weight.device == router.e_score_correction_bias.device
    assert torch.equal(router.weight.cpu(), weight)
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias.cpu(), bias)

    hidden = torch.randn(2, 9, 7168, generator=torch.Generator().manual_seed(1)).bfloat16()
    topk_weights, topk_ids, logits = router(hidden.to(device), return_logits=True)
    assert logits.device == topk_ids.device == router.weight.device
    topk_weights, topk_ids, logits = topk_weights.cpu(), topk_ids.cpu(), logits.cpu()
    expected_logits = reference.router_gemm(hidden.view(-1, 7168), weight)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=2e-3)
    p = PRESETS["deepseek-v3"]
    # Reference routing of the reference logits; near-exact ties may differ (routing_check).
    assert_routing_matches(topk_weights, topk_ids, expected_logits, bias, **p.op_kwargs())
    expected_w, _ = reference.biased_grouped_topk(expected_logits, bias, **p.op_kwargs())
    torch.testing.assert_close(topk_weights, expected_w, rtol=1e-4, atol=1e-5)


def test_bias_stays_fp32_through_dtype_casts(device):
    router = GroupedTopKRouter.from_preset("kimi-k2", 64, dtype=torch.float32)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(2 + 2.0**-12 * torch.arange(384))
    exact = router.e_score_correction_bias.clone()
    # The last cast moves the module too: the bias follows the device and keeps its dtype.
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16(),
                 lambda m: m.to(device, torch.bfloat16)):
        router = cast(router)
        assert router.e_score_correction_bias.dtype == torch.float32
        assert router.e_score_correction_bias.device == router.weight.device
        assert torch.equal(router.e_score_correction_bias.cpu(), exact)
    assert router.weight.dtype == torch.bfloat16
    # A bf16 bias round would have merged neighbours 2^-12 apart.
    assert exact.bfloat16().unique().numel() < 384


def test_loads_the_deepseek_inference_bias_name(device):
    router = GroupedTopKRouter.from_preset("deepseek-v3", 128, device=device)
    bias = torch.randn(256)
    router.load_state_dict({"weight": torch.zeros(256, 128, dtype=torch.bfloat16),
                            "bias": bias}, strict=True)
    assert router.e_score_correction_bias.device == router.weight.device
    assert torch.equal(router.e_score_correction_bias.cpu(), bias)


# A config.json read as a dict, or a config object with the keys as attributes (as
# transformers' PretrainedConfig holds them).
@pytest.mark.parametrize("as_object", [False, True], ids=["dict", "object"])
@pytest.mark.parametrize("config,expected", [
    (DEEPSEEK_V3_CONFIG, "deepseek-v3"), (KIMI_K2_CONFIG, "kimi-k2"),
    (GLM_45_CONFIG, "glm-4.5"), (DEEPSEEK_V2_CONFIG, "deepseek-v2"),
])
def test_from_config_matches_the_preset(config, expected, as_object):  # configuration only
    router = GroupedTopKRouter.from_config(types.SimpleNamespace(**config) if as_object
                                           else config)
    p = PRESETS[expected]
    assert (router.num_experts, router.num_expert_group, router.topk_group, router.top_k,
            router.routed_scaling_factor, router.scoring_func, router.renormalize) == (
        p.num_experts, p.num_expert_group, p.topk_group, p.topk, p.routed_scaling_factor,
        p.scoring_func, p.renormalize)
    assert router.hidden_size == config["hidden_size"]
    assert (router.e_score_correction_bias is not None) == p.has_bias
    assert ("e_score_correction_bias" in router.state_dict()) == p.has_bias


def test_from_config_defaults_where_the_config_is_silent():  # configuration only
    # DeepSeek-V3's config class defaults: norm_topk_prob True, noaux_tc (a bias), sigmoid;
    # an n_group or topk_group of null (configs without groups) is one group. A new router's
    # bias is zero, so it routes unbiased until a checkpoint loads one.
    router = GroupedTopKRouter.from_config(dict(hidden_size=32, n_routed_experts=16,
                                                n_group=None, topk_group=None))
    assert (router.num_expert_group, router.topk_group, router.top_k, router.renormalize,
            router.scoring_func, router.routed_scaling_factor) == (1, 1, 8, True, "sigmoid", 1.0)
    assert torch.equal(router.e_score_correction_bias, torch.zeros(16))


def test_from_config_keywords_override_every_setting():  # configuration only
    router = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG, hidden_size=64, num_experts=32,
                                           top_k=4)
    assert (router.hidden_size, router.num_experts, router.top_k) == (64, 32, 4)
    assert router.weight.shape == (32, 64)
    sizes = dict(hidden_size=48, n_routed_experts=16)
    for key, name in (("hidden_size", "hidden_size"), ("n_routed_experts", "num_experts")):
        config = {k: v for k, v in sizes.items() if k != key}
        with pytest.raises(ValueError, match=f"the config has no '{key}' \\(or pass {name}="):
            GroupedTopKRouter.from_config(config, top_k=4)
        router = GroupedTopKRouter.from_config(config, top_k=4, **{name: 16})
        assert router.weight.shape == (16, 48 if key == "n_routed_experts" else 16)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_routes_like_the_reference(device, preset):
    router = GroupedTopKRouter.from_preset(preset, 96)  # built on the CPU, then moved
    if router.e_score_correction_bias is not None:
        with torch.no_grad():
            router.e_score_correction_bias.normal_(2.0, 0.05)
    router = router.to(device)
    hidden = torch.randn(33, 96, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    topk_weights, topk_ids, logits = router(hidden, return_logits=True)
    assert logits.dtype == torch.float32 and logits.device == hidden.device
    assert torch.equal(logits, moeext.router_gemm(hidden, router.weight))
    assert_routing_matches(topk_weights, topk_ids, logits, router.e_score_correction_bias,
                           **PRESETS[preset].op_kwargs())


def test_bf16_logits(device):
    router = GroupedTopKRouter.from_preset("deepseek-v3", 200, logits_dtype=torch.bfloat16,
                                           device=device)
    hidden = torch.randn(5, 200, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
    _, _, logits = router(hidden, return_logits=True)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, moeext.router_gemm(hidden, router.weight, torch.bfloat16))
    with pytest.raises(ValueError, match="logits_dtype must be torch.float32 or torch.bfloat16"):
        GroupedTopKRouter(8, 4, logits_dtype=torch.float16)
    # A weight router_gemm cannot read fails when built, not at the first forward.
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16, torch.float16 or "
                                         "torch.float32, got torch.float64"):
        GroupedTopKRouter(8, 4, top_k=2, dtype=torch.float64)


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_expert_group=7), r"num_expert_group \(7\) must divide the number of experts"),
    (dict(num_expert_group=8, topk_group=9), r"topk_group must be in \[1, num_expert_group"),
    (dict(top_k=0), "topk must be >= 1, got 0"),
    (dict(top_k=65), r"topk \(65\) exceeds the experts in the kept groups"),
    (dict(scoring_func="sigmod"), "scoring_func must be 'sigmoid', 'sqrtsoftplus' or 'softmax'"),
])
def test_routing_settings_are_checked_when_built(kwargs, message):
    # Not at the first forward, long after the model was built.
    with pytest.raises(ValueError, match="GroupedTopKRouter: biased_grouped_topk: " + message):
        GroupedTopKRouter(64, 64, **kwargs)


def test_hidden_states_of_the_wrong_dtype_raise(device):
    router = GroupedTopKRouter.from_preset("glm-4.5", 64, device=device)
    with pytest.raises(RuntimeError, match=r"router_gemm: weight must have the dtype of "
                                           r"hidden_states \(Float\), got BFloat16"):
        router(torch.randn(3, 64, device=device))


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph(device, logits_dtype):
    torch._dynamo.reset()
    router = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG | {"hidden_size": 256},
                                           logits_dtype=logits_dtype, device=device)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(2.0, 0.05)
    compiled = torch.compile(router, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for num_tokens in (1, 7, 40):
        hidden = torch.randn(num_tokens, 256, generator=g).bfloat16().to(device)
        with torch.inference_mode():  # as engines run it: router_gemm has no autograd
            expected = router(hidden, return_logits=True)
            got = compiled(hidden, return_logits=True)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_prepacked_router_loads_a_checkpoint_and_routes_like_the_reference():
    """prepack_weight=True: the checkpoint's [E, H] weight is packed as it loads, routing
    matches the reference on the unpacked weight, and state_dict gives the layout back."""
    state = deepseek_v3_gate_state_dict()
    router = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG, prepack_weight=True)
    model = model_with_gate(router)
    model.load_state_dict(state, strict=True)
    weight = state["model.layers.3.mlp.gate.weight"]
    bias = state["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert router.weight.shape == (3584, 256, 2)
    assert torch.equal(router.weight, moeext.prepack_router_weight(weight))
    saved = model.state_dict()
    assert saved.keys() == state.keys()
    assert torch.equal(saved["model.layers.3.mlp.gate.weight"], weight)

    hidden = torch.randn(2, 3, 7168, generator=torch.Generator().manual_seed(1)).bfloat16()
    topk_weights, topk_ids, logits = router(hidden, return_logits=True)
    expected_logits = reference.router_gemm(hidden.view(-1, 7168), weight)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=2e-3)
    p = PRESETS["deepseek-v3"]
    assert_routing_matches(topk_weights, topk_ids, expected_logits, bias, **p.op_kwargs())


def test_prepacked_and_unpacked_routers_exchange_state_dicts():
    packed = GroupedTopKRouter.from_preset("glm-4.5", 101, prepack_weight=True)
    plain = GroupedTopKRouter.from_preset("glm-4.5", 101)
    plain.load_state_dict(packed.state_dict())
    assert torch.equal(moeext.prepack_router_weight(plain.weight), packed.weight)
    with torch.no_grad():
        plain.weight.normal_(0, 0.02)
    packed.load_state_dict(plain.state_dict())
    assert torch.equal(packed.state_dict()["weight"], plain.weight)
    assert "prepack_weight=True" in repr(packed)
    # A weight packed already (the parameter itself, copied) loads as it is; a state dict
    # without a weight leaves the packed one in place.
    other = GroupedTopKRouter.from_preset("glm-4.5", 101, prepack_weight=True)
    other.load_state_dict({"weight": packed.weight.detach().clone(),
                           "e_score_correction_bias": packed.e_score_correction_bias})
    assert torch.equal(other.weight, packed.weight)
    missing = other.load_state_dict({"e_score_correction_bias": torch.ones(160)}, strict=False)
    assert missing.missing_keys == ["weight"] and torch.equal(other.weight, packed.weight)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=torch.float32), r"GroupedTopKRouter: prepack_weight needs a bfloat16 weight on "
                                r"the CPU, got dtype torch.float32 on cpu"),
    (dict(device="meta"), r"GroupedTopKRouter: prepack_weight needs a bfloat16 weight on the "
                          r"CPU, got dtype torch.bfloat16 on meta"),
])
def test_prepack_weight_needs_bf16_on_the_cpu(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupedTopKRouter.from_preset("glm-4.5", 64, prepack_weight=True, **kwargs)


def test_compile_fullgraph_prepacked():
    torch._dynamo.reset()
    router = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG | {"hidden_size": 257},
                                           prepack_weight=True)
    compiled = torch.compile(router, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for num_tokens in (1, 7, 40):
        hidden = torch.randn(num_tokens, 257, generator=g).bfloat16()
        with torch.inference_mode():
            expected = router(hidden, return_logits=True)
            got = compiled(hidden, return_logits=True)
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_trains_through_the_gate(device):
    # The routing weights' gradient reaches the router weight as it does through the
    # reference ops (torch's autograd through fp64 products and plain-PyTorch routing).
    router = GroupedTopKRouter.from_preset("deepseek-v3", 96, dtype=torch.float32).to(device)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(2.0, 0.05)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 5, 96, generator=g).to(device)
    grad_weights = torch.randn(10, 8, generator=g).to(device)
    topk_weights, _ = router(hidden)
    (topk_weights * grad_weights).sum().backward()

    weight = router.weight.detach().clone().requires_grad_()
    logits = moeext.reference.router_gemm(hidden.reshape(-1, 96), weight)
    expected, _ = moeext.reference.biased_grouped_topk(
        logits, router.e_score_correction_bias, **PRESETS["deepseek-v3"].op_kwargs())
    (expected * grad_weights).sum().backward()
    assert router.e_score_correction_bias.grad is None
    torch.testing.assert_close(router.weight.grad, weight.grad, rtol=1e-4, atol=1e-6)


def test_prepacked_weight_is_frozen():
    router = GroupedTopKRouter.from_preset("kimi-k2", 64, prepack_weight=True)
    assert not router.weight.requires_grad
    hidden = torch.randn(3, 64).bfloat16()
    topk_weights, _ = router(hidden)  # grad mode on, nothing requires grad: runs
    assert not topk_weights.requires_grad
    with pytest.raises(RuntimeError, match="router_gemm: hidden_states requires grad"):
        router(hidden.requires_grad_())


# ---- What engines and trainers need (docs/SPEC.md section 6) --------------------------------


@pytest.mark.parametrize("placement,ranks", [
    ("linear", [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]),      # 10 experts on 4 ranks: 3, 3, 2, 2
    ("round_robin", [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]),
    ([3, 3, 0, 1, 2, 0, 1, 2, 0, 3], [3, 3, 0, 1, 2, 0, 1, 2, 0, 3]),
])
def test_expert_parallel_map_gives_each_rank_its_experts(placement, ranks):
    held = [0] * 4
    maps = [moeext.nn.expert_parallel_map(10, r, 4, placement, num_fused_shared_experts=2)
            for r in range(4)]
    for e, owner in enumerate(ranks):
        for r in range(4):
            expected = held[r] if r == owner else -1
            assert int(maps[r][e]) == expected, (placement, e, r)
        held[owner] += 1
    for r in range(4):  # the shared experts: on every rank, after its routed ones
        assert maps[r].dtype == torch.int32 and maps[r][10:].tolist() == [held[r], held[r] + 1]


@pytest.mark.parametrize("call,message", [
    (lambda: moeext.nn.expert_parallel_map(8, 4, 4), "ep_rank must be in"),
    (lambda: moeext.nn.expert_parallel_map(8, 0, 2, "striped"), "placement must be 'linear'"),
    (lambda: moeext.nn.expert_parallel_map(8, 0, 2, [0, 1]), "placement must give each"),
    (lambda: moeext.nn.expert_parallel_map(3, 0, 2, [0, 1, 2]), "placement must give each"),
])
def test_expert_parallel_map_names_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_correction_bias_moves_a_step_towards_balance():
    bias = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0])
    counts = torch.tensor([10, 4, 6, 6, 4], dtype=torch.int32)  # mean 6
    moeext.nn.update_correction_bias_(bias, counts, 0.001)
    torch.testing.assert_close(bias, torch.tensor([1.999, 2.001, 2.0, 2.0, 2.001]), rtol=0,
                               atol=1e-7)
    with pytest.raises(ValueError, match="expert_counts must have the shape"):
        moeext.nn.update_correction_bias_(bias, counts[:4], 0.001)


def test_router_fuses_shared_experts_maps_counts_and_records(device):
    config = dict(DEEPSEEK_V3_CONFIG, n_shared_experts=1)
    router = GroupedTopKRouter.from_config(config, fuse_shared_experts=True, device=device)
    model_with_gate(router).load_state_dict(deepseek_v3_gate_state_dict(), strict=True)
    assert router.num_fused_shared_experts == 1
    expert_map = moeext.nn.expert_parallel_map(256, 1, 8, num_fused_shared_experts=1)
    router.set_expert_map(expert_map)
    counts = router.track_expert_counts()
    record = router.record_routing(16)
    hidden = torch.randn(5, 7168).bfloat16().to(device)
    weights, ids = router(hidden)
    plain = GroupedTopKRouter.from_config(DEEPSEEK_V3_CONFIG, device=device)
    plain.load_state_dict(router.state_dict())  # engine state stays out of the state dict
    plain_weights, plain_ids = plain(hidden)
    assert weights.shape == ids.shape == (5, 9)
    assert torch.equal(weights[:, :8], plain_weights) and bool((weights[:, 8] == 1.0).all())
    logical = torch.cat([plain_ids, torch.full((5, 1), 256, device=device)], dim=1)
    assert torch.equal(ids.cpu(), expert_map[logical.long().cpu()])
    assert torch.equal(record[:5], plain_ids.to(torch.int16))
    assert int(counts.sum()) == 40
    assert "expert_counts" not in router.state_dict()
    before = router.e_score_correction_bias.clone()
    router.update_correction_bias_(0.001)
    assert int(router.expert_counts.sum()) == 0
    assert not torch.equal(router.e_score_correction_bias, before)


def test_router_counts_and_records_only_valid_rows(device):
    router = GroupedTopKRouter.from_preset("kimi-k2", 64, device=device, dtype=torch.float32)
    router.track_expert_counts(torch.int32)
    router.record_routing(8, torch.int32)
    router.routed_experts.fill_(-1)
    _, ids = router(torch.randn(6, 64, device=device),
                    num_valid_tokens=torch.tensor([4], device=device))
    assert int(router.reset_expert_counts().sum()) == 4 * 8
    assert torch.equal(router.routed_experts[:4], ids[:4])
    assert bool((router.routed_experts[4:] == -1).all())


def test_replay_gives_the_recorded_weights_and_their_gradient(device):
    router = GroupedTopKRouter.from_preset("deepseek-v3", 96, device=device, dtype=torch.float32)
    record = router.record_routing(4, torch.int32)
    hidden = torch.randn(4, 96, device=device)
    weights, _ = router(hidden)
    replayed = router.replay(hidden, record)
    assert torch.equal(replayed, weights)
    (replayed * torch.arange(8.0, device=device)).sum().backward()
    grad = router.weight.grad.clone()
    router.weight.grad = None
    logits = hidden @ router.weight.T
    (reference.routing_weights(logits, record, True, router.routed_scaling_factor, "sigmoid")
     * torch.arange(8.0, device=device)).sum().backward()
    torch.testing.assert_close(grad, router.weight.grad, rtol=1e-4, atol=1e-6)


def test_compile_router_with_every_option(device):
    torch._dynamo.reset()
    router = GroupedTopKRouter.from_preset("deepseek-v3", 64, device=device, dtype=torch.float32,
                                           num_fused_shared_experts=1,
                                           expert_map=torch.arange(257, dtype=torch.int32))
    router.track_expert_counts()
    router.record_routing(32)
    compiled = torch.compile(router, fullgraph=True, dynamic=True)
    for num_tokens in (3, 9, 20):
        hidden = torch.randn(num_tokens, 64, device=device)
        valid = torch.tensor([num_tokens - 1], device=device)
        got = compiled(hidden, num_valid_tokens=valid)
        counts = router.expert_counts.clone()
        expected = router(hidden, num_valid_tokens=valid)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert int(router.expert_counts.sum() - counts.sum()) == (num_tokens - 1) * 8
