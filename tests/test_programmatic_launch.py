"""Programmatic dependent launch (PDL) of the decode-path GPU kernels, an opt-in: the setting,
its environment variable, and, on a GPU, that it changes no result.

The setting (``moeext.set_programmatic_dependent_launch``) is tested everywhere. On a GPU
every kernel that can be launched with PDL runs both ways on the same inputs and must give the
same bits, eagerly and in CUDA graphs captured with PDL on, including chains of dependent
kernels back to back (router_gemm then biased_grouped_topk then routing_weights, fused_router
twice in a row on one stream, as its two kernels and as its one launch with one completion
counter) fed new inputs at every call, so that a
kernel that touched memory before waiting for the previous one would read stale logits or
corrupt the shared counter. A GPU without sm_90 code runs the same tests with plain launches.
"""

import os
import subprocess
import sys

import pytest
import torch

import moeext
from conftest import GPU_DEVICES, switched
from moeext.presets import PRESETS

# ---- The setting ---------------------------------------------------------------------------


def pdl(enabled):
    return switched(moeext.set_programmatic_dependent_launch, enabled)


def fused_variant(variant):
    """How fused_router calls run (moeext::gpu_fused_router_variant): 0 the two kernels, 1 the
    one launch, 3 the one launch with the gate's own routing."""
    return switched(moeext._C._set_gpu_fused_router_variant, variant)


def test_set_returns_the_previous_value_and_the_getter_follows():
    before = moeext.programmatic_dependent_launch()
    try:
        assert moeext.set_programmatic_dependent_launch(True) is before
        assert moeext.programmatic_dependent_launch() is True
        assert moeext.set_programmatic_dependent_launch(True) is True
        assert moeext.set_programmatic_dependent_launch(False) is True
        assert moeext.programmatic_dependent_launch() is False
        assert moeext.set_programmatic_dependent_launch(False) is False
    finally:
        moeext.set_programmatic_dependent_launch(before)
    assert moeext.programmatic_dependent_launch() is before


@pytest.mark.parametrize("value", [1, 0, None, "1", 1.0])
def test_set_takes_a_bool_only(value):
    before = moeext.programmatic_dependent_launch()
    with pytest.raises(TypeError, match="set_programmatic_dependent_launch: enabled must be a "
                                        f"bool, got {type(value).__name__}"):
        moeext.set_programmatic_dependent_launch(value)
    assert moeext.programmatic_dependent_launch() is before


def test_the_context_restores_the_setting():
    before = moeext.programmatic_dependent_launch()
    with pdl(not before):
        assert moeext.programmatic_dependent_launch() is (not before)
    assert moeext.programmatic_dependent_launch() is before


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False),
                                            ("1", True)])
def test_the_environment_values(value, expected):
    parse = moeext.ops._programmatic_dependent_launch_from_environment
    assert parse(value) is expected


@pytest.mark.parametrize("value", ["true", "on", "2", " 1", "1 ", "01", "yes", "False"])
def test_any_other_environment_value_is_an_error_naming_the_variable(value):
    parse = moeext.ops._programmatic_dependent_launch_from_environment
    with pytest.raises(ValueError, match=r"MOEEXT_ENABLE_PDL must be '1' .* or '0' .*, got "
                                         + repr(value).replace(" ", r"\s")):
        parse(value)


def _import_with(value):
    env = {k: v for k, v in os.environ.items() if k != "MOEEXT_ENABLE_PDL"}
    if value is not None:
        env["MOEEXT_ENABLE_PDL"] = value
    return subprocess.run(
        [sys.executable, "-c", "import moeext; print(moeext.programmatic_dependent_launch())"],
        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value,expected", [(None, "False"), ("", "False"), ("0", "False"),
                                            ("1", "True")])
def test_the_environment_sets_the_initial_value(value, expected):
    """Off unless MOEEXT_ENABLE_PDL=1, read when moeext is imported."""
    child = _import_with(value)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == expected


def test_a_bad_environment_value_fails_the_import():
    child = _import_with("true")
    assert child.returncode != 0
    assert "ValueError: MOEEXT_ENABLE_PDL must be '1'" in child.stderr
    assert "got 'true'" in child.stderr


def test_no_effect_without_a_cuda_device():
    if torch.cuda.is_available() and "cuda" in moeext.build_info()["backends"]:
        pytest.skip("a GPU is present: test_supported_where_the_device_runs_sm90_code decides")
    assert moeext._C.programmatic_dependent_launch_supported() is False


@pytest.mark.parametrize("enabled", [False, True])
def test_the_cpu_ops_are_unaffected(enabled):
    p = PRESETS["deepseek-v3"]
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 256, generator=g).bfloat16()
    weight = (0.05 * torch.randn(p.num_experts, 256, generator=g)).bfloat16()
    bias = 2 + 0.05 * torch.randn(p.num_experts, generator=g)
    expected = moeext.fused_router(hidden, weight, bias, **p.op_kwargs())[:2]
    with pdl(enabled):
        got = moeext.fused_router(hidden, weight, bias, **p.op_kwargs())[:2]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ---- On a GPU ------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(
    not GPU_DEVICES,
    reason="programmatic dependent launch needs a GPU and a moeext build with the cuda backend")


@pytest.fixture(params=GPU_DEVICES)
def gpu(request):
    device = torch.device(request.param)
    index = torch.cuda.current_device() if device.index is None else device.index
    with torch.cuda.device(index):
        yield torch.device("cuda", index)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_bits(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(_bits(g), _bits(e))


def _gate(num_tokens, hidden_size, preset, seed, device, calls):
    """``calls`` input sets (hidden, weight) and the preset's fp32 bias, on ``device``."""
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    sets = [(torch.randn(num_tokens, hidden_size, generator=g).bfloat16().to(device),
             (0.02 * torch.randn(p.num_experts, hidden_size, generator=g)).bfloat16().to(device))
            for _ in range(calls)]
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)).to(device) if p.has_bias else None
    return sets, bias


@gpu_only
def test_supported_where_the_device_runs_sm90_code(gpu):
    """True exactly on a CUDA device of compute capability 9.0+ whose code this build has
    compiled for sm_90+ (else the device JIT-compiles the compute_80 PTX, which has no wait)."""
    major, minor = torch.cuda.get_device_capability(gpu)
    archs = moeext.build_info()["gpu_architectures"].split(",")
    compiled_for_it = any(a.rstrip("af") == f"{major}{minor}" for a in archs)
    expected = torch.version.hip is None and major >= 9 and compiled_for_it
    assert moeext._C.programmatic_dependent_launch_supported() is expected


def _both_ways(run):
    """``run()`` with PDL off, then on: both results, synchronised."""
    results = []
    for enabled in (False, True):
        with pdl(enabled):
            results.append(run())
        torch.cuda.synchronize()
    return results


@gpu_only
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2", "deepseek-v2", "nemotron-style"])
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 300])
def test_routing_is_the_same_bits_both_ways(gpu, preset, num_tokens):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    logits = [(2 * torch.randn(num_tokens, p.num_experts, generator=g)).to(dtype).to(gpu)
              for dtype in (torch.bfloat16, torch.float32, torch.float16)]
    logits[0][-1] = float("nan")  # a CUDA-graph padding row
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)).to(gpu) if p.has_bias else None
    counts = torch.zeros(p.num_experts, dtype=torch.int32, device=gpu)

    def run():
        counts.zero_()
        out = [moeext.biased_grouped_topk(x, bias, **p.op_kwargs()) for x in logits]
        # The options' instances (counts written atomically, a shared expert appended).
        out.append(moeext.biased_grouped_topk(logits[1], bias, **p.op_kwargs(),
                                              num_fused_shared_experts=1,
                                              expert_counts=counts))
        return [t for pair in out for t in pair] + [counts.clone()]

    off, on = _both_ways(run)
    assert_same_bits(on, off)


@gpu_only
def test_the_block_routing_kernel_is_the_same_bits_both_ways(gpu):
    """2048 experts: past the warp kernel's 1024, the block kernel routes."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 2048, generator=g).to(gpu)
    bias = torch.randn(2048, generator=g).to(gpu)

    def run():
        return moeext.biased_grouped_topk(logits, bias, num_expert_group=8, topk_group=4, topk=8)

    off, on = _both_ways(run)
    assert_same_bits(on, off)


@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 4, 9, 16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_router_gemm_is_the_same_bits_both_ways(gpu, num_tokens, out_dtype):
    sets, _ = _gate(num_tokens, 7168, "deepseek-v3", num_tokens, gpu, calls=4)

    def run():
        return [moeext.router_gemm(x, w, out_dtype) for x, w in sets]

    off, on = _both_ways(run)
    assert_same_bits(on, off)


@gpu_only
@pytest.mark.parametrize("variant", [0, 1, 3], ids=["two-kernels", "one-launch", "one-launch-gate"])
@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2", "nemotron-style"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_fused_router_is_the_same_bits_both_ways(gpu, preset, num_tokens, variant):
    p = PRESETS[preset]
    sets, bias = _gate(num_tokens, 7168, preset, num_tokens, gpu, calls=4)

    def run():
        return [t for x, w in sets
                for t in moeext.fused_router(x, w, bias, **p.op_kwargs(), return_logits=True)]

    with fused_variant(variant):
        off, on = _both_ways(run)
    assert_same_bits(on, off)


@gpu_only
@pytest.mark.parametrize("scoring_func", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("ids_dtype", [torch.int16, torch.int32, torch.int64])
def test_routing_weights_is_the_same_bits_both_ways(gpu, scoring_func, ids_dtype):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(33, 256, generator=g).bfloat16().to(gpu)
    ids = torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(33)]).to(ids_dtype)
    ids[-1, 1] = ids[-1, 0]  # a repeated id: that row's weights are NaN both ways
    ids = ids.to(gpu)

    def run():
        return [moeext.routing_weights(logits, ids, True, 2.5, scoring_func)]

    off, on = _both_ways(run)
    assert_same_bits(on, off)


def _dependent_chain(x, w, bias, p):
    """router_gemm -> biased_grouped_topk -> routing_weights: each kernel reads what the one
    before it wrote."""
    logits = moeext.router_gemm(x, w)
    weights, ids = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
    replayed = moeext.routing_weights(logits, ids, p.renormalize, p.routed_scaling_factor,
                                      p.scoring_func)
    return [logits, weights, ids, replayed]


@gpu_only
def test_back_to_back_dependent_calls_eagerly(gpu):
    """50 chains queued without a synchronisation, each on new inputs: a kernel that read
    before its wait would see the previous chain's logits or ids."""
    p = PRESETS["deepseek-v3"]
    sets, bias = _gate(4, 7168, "deepseek-v3", 1, gpu, calls=50)
    off, on = _both_ways(lambda: [t for x, w in sets for t in _dependent_chain(x, w, bias, p)])
    assert_same_bits(on, off)
    # The chain is self-consistent: replaying routing's ids gives routing's weights.
    for i in range(0, len(on), 4):
        assert torch.equal(on[i + 3].view(torch.int32), on[i + 1].view(torch.int32))


def _capture(fn, device):
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
        outputs = fn()
    return graph, outputs


@gpu_only
@pytest.mark.parametrize("variant", [0, 1, 3], ids=["two-kernels", "one-launch", "one-launch-gate"])
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_a_graph_captured_with_pdl_replays_correctly(gpu, num_tokens, variant):
    """One graph captured with PDL on holds the dependent chain and fused_router twice in a
    row (as the one launch: one completion counter for the capture, and the second launch's
    GEMM may start while the first's last block still routes); each replay on new inputs must
    give the bits of the same calls made eagerly with PDL off."""
    p = PRESETS["deepseek-v3"]
    sets, bias = _gate(num_tokens, 7168, "deepseek-v3", num_tokens, gpu, calls=8)
    static = [(sets[0][0].clone(), sets[0][1].clone()), (sets[1][0].clone(), sets[1][1].clone())]

    def calls():
        (x0, w0), (x1, w1) = static
        out = _dependent_chain(x0, w0, bias, p)
        out += list(moeext.fused_router(x0, w0, bias, **p.op_kwargs())[:2])
        out += list(moeext.fused_router(x1, w1, bias, **p.op_kwargs())[:2])
        out += list(moeext.fused_router(x1, w0, bias, **p.op_kwargs(), return_logits=True))
        return out

    with pdl(True), fused_variant(variant):
        graph, outputs = _capture(calls, gpu)
    for i in range(2, len(sets), 2):
        for (x, w), new in zip(static, (sets[i], sets[i + 1])):
            x.copy_(new[0])
            w.copy_(new[1])
        with pdl(False):  # the graph keeps the mode it was captured in
            graph.replay()
            torch.cuda.synchronize()
            expected = calls()
        assert_same_bits(outputs, expected)


@gpu_only
def test_graphs_replayed_back_to_back(gpu):
    """Two graphs, each captured with PDL on, replayed alternately without a synchronisation
    on one stream; their fused_router launches (the one launch) each have their capture's
    counter."""
    p = PRESETS["kimi-k2"]
    sets, bias = _gate(8, 7168, "kimi-k2", 2, gpu, calls=2)
    with pdl(True), fused_variant(1):
        graphs = [_capture(lambda x=x, w=w: list(moeext.fused_router(x, w, bias,
                                                                     **p.op_kwargs())[:2]), gpu)
                  for x, w in sets]
    for _ in range(20):
        for graph, _ in graphs:
            graph.replay()
    torch.cuda.synchronize()
    for (x, w), (_, outputs) in zip(sets, graphs):
        assert_same_bits(outputs, list(moeext.fused_router(x, w, bias, **p.op_kwargs())[:2]))


@gpu_only
def test_torch_compile_sees_the_same_ops(gpu):
    """The ops are opaque to torch.compile: a compiled chain runs in the mode set when it
    runs and gives the eager bits."""
    p = PRESETS["deepseek-v3"]
    sets, bias = _gate(4, 7168, "deepseek-v3", 3, gpu, calls=3)
    compiled = torch.compile(lambda x, w: _dependent_chain(x, w, bias, p), fullgraph=True)
    for x, w in sets:
        expected = _dependent_chain(x, w, bias, p)
        with pdl(True):
            got = compiled(x, w)
        torch.cuda.synchronize()
        assert_same_bits(got, expected)
