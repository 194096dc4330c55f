"""The GPU kernels run on the host (tests/gpu_emulation/): the emulation's own checks, and what
the suite's emulated runs (conftest's ``device_isa``) do not cover, the kernel variants kept
for a GPU's A/B (moeext/common.h: routing 1-5, router GEMM 1, the fused router's one launch
1-3), launches with programmatic dependent launch, the orders a block's threads run in, and the
routing property tests (test_grouped_topk.py's problems, drawn by hypothesis).

None of these may change a bit: every result here is compared with torch.equal against variant
0 run forward without PDL, and that against the reference as the suite compares it. The
emulation builds the kernels for the host as CUDA for sm_90 and as HIP for CDNA (64-lane
wavefronts), so it checks the kernels' logic; the device's arithmetic (CUDA's expf) and speed
need a GPU.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given

from conftest import (EMULATED_GPUS, emulated_gpu_module, emulated_ops, emulated_ops_file,
                      emulation_build_root, emulation_file)
from moeext import reference
from moeext.presets import PRESETS
from routing_check import assert_routing_matches, assert_valid_routing
from test_grouped_topk import (near_tie_problem_inputs, near_tie_problems, routing_problem_inputs,
                               routing_problems)

HERE = Path(__file__).resolve().parent / "gpu_emulation"
SCORING = emulated_ops_file().SCORING
ORDERS = {"forward": 0, "backward": 1, "shuffled": 2}
MULTIPROCESSORS = 132  # an H100's or H200's: the grids the launchers size for them

pytestmark = pytest.mark.skipif(not EMULATED_GPUS, reason="MOEEXT_TEST_GPU_EMULATION=0")


@pytest.fixture(params=EMULATED_GPUS)
def emu(request):
    return emulated_gpu_module(request.param)


def _configure(emu, order=0, routing=0, gemm=0, fused=0, seed=1, pdl=False):
    emu.configure(order, seed, MULTIPROCESSORS, routing, gemm, fused, pdl)


def _bits(*tensors):
    return [t.view(torch.int32) if t.dtype == torch.float32 else t for t in tensors]


def _assert_same_bits(got, expected, what):
    for g, e in zip(_bits(*got), _bits(*expected)):
        assert torch.equal(g, e), what


@pytest.mark.parametrize("warp_size", [32, 64])
def test_the_emulation_itself(warp_size, tmp_path):
    """Barriers, shuffles and ballots as on the GPU, and the faults reported: a deadlock, lanes
    at different collectives, a lane gone from a collective, a read missing its barrier."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "test_runtime"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
         f"-DMOEEXT_EMU_WARP_SIZE={warp_size}", f"-I{HERE / 'include'}",
         str(HERE / "test_runtime.cpp"), str(HERE / "runtime.cpp"), "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


RACE_CASES = ["warp-sync", "race-shuffle-only", "overwrite-after-warp-sync",
              "race-overwrite-after-shuffles", "block-barrier", "race-other-warp-after-warp-sync",
              "atomic-count", "race-plain-count", "host-and-launch"]


def _thread_sanitizer():
    """The compiler and ThreadSanitizer's runtime library (for LD_PRELOAD), or a skip."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip("no C++ compiler")
    found = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True,
                           text=True).stdout.strip()
    if not os.path.isabs(found) or not os.path.exists(found):
        pytest.skip(f"{cxx} has no ThreadSanitizer runtime (libtsan)")
    return cxx, os.path.realpath(found)


def _sanitized_env(library):
    return dict(os.environ, LD_PRELOAD=library, OMP_NUM_THREADS="1",
                TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_thread_leaks=0")


@pytest.fixture(scope="module")
def race_cases_binary(tmp_path_factory):
    emulation_build_root()  # the skips: x86-64 fibers, a compiler
    cxx, library = _thread_sanitizer()
    out = tmp_path_factory.mktemp("races")
    flags = ["-std=c++17", "-DMOEEXT_EMU_RACES=1", "-DMOEEXT_EMU_WARP_SIZE=32"]
    runtime = emulation_file("prepare").runtime_object(out, flags)
    binary = out / "test_races"
    build = subprocess.run(
        [cxx, "-O1", "-g1", "-Wall", "-Wextra", "-Werror", "-fsanitize=thread", *flags,
         f"-I{HERE / 'include'}", str(HERE / "test_races.cpp"), str(runtime), "-o",
         str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return binary, library


@pytest.mark.parametrize("case", RACE_CASES)
def test_the_race_build_reports_what_a_gpu_leaves_unordered(race_cases_binary, case):
    """ThreadSanitizer over the emulation (runtime.cpp's MOEEXT_EMU_RACES) reports a race for a
    read a shuffle alone 'orders', for an overwrite of what the other lanes still read, across
    warps a warp sync does not order and for plain increments; and nothing where a warp sync,
    a barrier, an atomic or the launch itself orders the accesses."""
    binary, library = race_cases_binary
    run = subprocess.run([str(binary), case], capture_output=True, text=True, timeout=120,
                         env=_sanitized_env(library))
    if case.startswith("race-"):
        assert run.returncode == 66 and "data race" in run.stderr, run.stdout + run.stderr
    else:
        assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize("flavour", EMULATED_GPUS)
def test_no_data_race_in_the_kernels(flavour):
    """Every kernel the GPU binding launches, on shapes taking each of its paths, built for
    ThreadSanitizer (gpu_emulation/races.py): no two threads of a block touch the same memory,
    one of them writing, without a barrier, a warp sync or an atomic between them."""
    root = emulation_build_root()
    _, library = _thread_sanitizer()
    run = subprocess.run([sys.executable, str(HERE / "races.py"), str(root), flavour],
                         capture_output=True, text=True, timeout=3600,
                         env=_sanitized_env(library))
    assert run.returncode == 0, (run.stdout + run.stderr)[-20000:]
    assert "no data race" in run.stdout


# ---- routing ------------------------------------------------------------------------------

def _route(emu, logits, bias, p):
    return emulated_ops_file().route(emu, logits, bias, p.op_kwargs())


ROUTING_CASES = [(preset, dtype, num_tokens)
                 for preset in ("deepseek-v3", "kimi-k2", "deepseek-v4-flash", "deepseek-v4-pro",
                                "nemotron-style", "deepseek-v2", "glm-4.5")
                 for dtype in (torch.float32, torch.bfloat16)
                 for num_tokens in (1, 37, 300)]


@pytest.mark.parametrize("preset,dtype,num_tokens", ROUTING_CASES,
                         ids=[f"{p}-{str(d)[6:]}-{t}" for p, d, t in ROUTING_CASES])
def test_routing_variants_and_orders_change_no_bit(emu, preset, dtype, num_tokens):
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    logits = (2 * torch.randn(num_tokens, p.num_experts, generator=g)).to(dtype)
    logits[num_tokens // 2, : p.num_experts // 2] = 0.5  # a row of ties
    if num_tokens > 2:
        # b of -inf everywhere: no lane past the row may win, whatever it holds.
        logits[-1] = float("nan")
        logits[1, ::2] = float("-inf")
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)) if p.has_bias else None
    _configure(emu)
    expected = _route(emu, logits, bias, p)
    assert_routing_matches(*expected, logits, bias, **p.op_kwargs())
    for variant in (0, 1, 2, 4, 5, 6, 7, 8):
        for order, code in ORDERS.items():
            _configure(emu, order=code, routing=variant, seed=variant, pdl=code == 1)
            _assert_same_bits(_route(emu, logits, bias, p), expected,
                              f"routing variant {variant}, {order} order")
    _configure(emu)


THREAD_CASES = [(preset, dtype, bias_dtype) for preset in ("deepseek-v3", "kimi-k2")
                for dtype in (torch.float32, torch.bfloat16, torch.float16)
                for bias_dtype in (torch.float32, torch.bfloat16, None)]


@pytest.mark.parametrize("variant", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("preset,dtype,bias_dtype", THREAD_CASES,
                         ids=[f"{p}-{str(d)[6:]}-{str(b)[6:]}" for p, d, b in THREAD_CASES])
def test_routing_variants_4_to_8_route_a_gate_as_the_warp_kernel(emu, preset, dtype,
                                                                 bias_dtype, variant):
    """Routing variants 4 (a gate's plain calls one thread a token, grouped_topk_thread.h), 5
    (a token a block, grouped_topk_gate_block.h), 6 (the gate's warp kernel instance scoring
    each lane's experts as a chunk), 7 (a token two threads) and 8 (the topk by a butterfly of
    the lanes' sorted lists): the current kernel's ids and
    weights on rows of NaN, inf, -inf (some winning by their bias), subnormal scores and ties
    (every expert equal, and equal b across groups), a column-strided view, more tokens than
    one block takes (150: not a whole number of blocks), and without a renormalisation; on
    HIP's 64-lane build the warp kernel routes it."""
    p = PRESETS[preset]
    num_tokens = 150
    g = torch.Generator().manual_seed(len(preset) + num_tokens)
    logits = (2 * torch.randn(num_tokens, p.num_experts, generator=g)).to(dtype)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2, : p.num_experts // 2] = float("inf")
    logits[3] = 0.0  # every expert ties
    logits[4, ::2] = float("-inf")
    logits[5, 7::32] = 9.0  # the same expert of each group ties across groups
    logits[6] = logits[6, :8].repeat(p.num_experts // 8)  # each group the same values
    # -inf's score is 0, so a bias ranks them (1 / (1 + exp(inf)) has no fast reciprocal);
    # below about -87.3 the score is subnormal, ranked by its value without a bias.
    logits[7] = float("-inf")
    logits[7, [0, 40, 77]] = 1.0
    logits[8] = -88.0 - 14.0 * torch.rand(p.num_experts, generator=g)
    bias = (None if bias_dtype is None
            else (2 + 0.05 * torch.randn(p.num_experts, generator=g)).to(bias_dtype))
    wide = torch.zeros(num_tokens, 2 * p.num_experts, dtype=dtype)
    wide[:, 1::2] = logits
    for inputs in (logits, wide[:, 1::2]):
        for renormalize in (True, False):
            kw = dict(p.op_kwargs(), renormalize=renormalize)
            _configure(emu)
            expected = emulated_ops_file().route(emu, inputs, bias, kw)
            _configure(emu, routing=variant, order=2, pdl=True)
            _assert_same_bits(emulated_ops_file().route(emu, inputs, bias, kw), expected,
                              f"routing variant {variant}, renormalize={renormalize}")
    _configure(emu)


OPTIONS_CASES = [(preset, dtype, num_tokens) for preset in ("deepseek-v3", "kimi-k2")
                 for dtype in (torch.float32, torch.bfloat16) for num_tokens in (1, 37)]


@pytest.mark.parametrize("preset,dtype,num_tokens", OPTIONS_CASES,
                         ids=[f"{p}-{str(d)[6:]}-{t}" for p, d, t in OPTIONS_CASES])
def test_routing_variant_3_is_the_current_kernel_with_options(emu, preset, dtype, num_tokens):
    """Routing variant 3 routes a call with options of a gate with its own warp kernel instance
    with that instance: the same ids, weights, counts and record as the current kernel's
    generic options instance, each option alone and all together, on rows of ties, NaN and
    inf; and those the reference's options applied to the plain routing."""
    p = PRESETS[preset]
    g = torch.Generator().manual_seed(num_tokens)
    logits = (2 * torch.randn(num_tokens, p.num_experts, generator=g)).to(dtype)
    logits[num_tokens // 2, : p.num_experts // 2] = 0.5  # ties
    logits[num_tokens - 1, ::3] = float("nan")
    logits[0, 1::5] = float("inf")
    bias = 2 + 0.05 * torch.randn(p.num_experts, generator=g)
    expert_map = torch.full((p.num_experts + 2,), -1, dtype=torch.int32)
    expert_map[::3] = torch.arange(expert_map[::3].numel(), dtype=torch.int32)
    valid = torch.tensor([num_tokens - num_tokens // 3], dtype=torch.int64)
    every = dict(num_fused_shared_experts=2, shared_expert_weight=0.25, expert_map=expert_map,
                 num_valid_tokens=valid)
    ops = emulated_ops_file().EmulatedOps(emu)

    def run(variant, options, counts_dtype, record_dtype):
        _configure(emu, routing=variant, order=variant % 3, pdl=variant == 3)
        counts = None if counts_dtype is None else torch.arange(p.num_experts).to(counts_dtype)
        routed = (None if record_dtype is None
                  else torch.full((num_tokens + 1, p.topk), -5, dtype=record_dtype))
        weights, ids = ops.biased_grouped_topk(logits, bias, **p.op_kwargs(), **options,
                                               expert_counts=counts, routed_experts=routed)
        return [t for t in (weights, ids, counts, routed) if t is not None]

    cases = [({}, torch.int32, None), ({}, None, torch.int16),
             (dict(num_fused_shared_experts=1), None, None),
             (dict(expert_map=expert_map[: p.num_experts]), None, None),
             (every, torch.int64, torch.int32)]
    _configure(emu)
    plain = _route(emu, logits, bias, p)
    for options, counts_dtype, record_dtype in cases:
        expected = run(0, options, counts_dtype, record_dtype)
        _assert_same_bits(run(3, options, counts_dtype, record_dtype), expected,
                          f"routing variant 3, options {sorted(options)}")
        counts = None if counts_dtype is None else torch.arange(p.num_experts).to(counts_dtype)
        routed = (None if record_dtype is None
                  else torch.full((num_tokens + 1, p.topk), -5, dtype=record_dtype))
        weights, ids = reference.apply_routing_options(
            *plain, p.num_experts, expert_counts=counts, routed_experts=routed, **options)
        reference_results = [t for t in (weights, ids, counts, routed) if t is not None]
        _assert_same_bits(expected, reference_results, f"options {sorted(options)}")
    _configure(emu)


# ---- router GEMM and fused router ---------------------------------------------------------

def _gemm_inputs(num_tokens, num_experts, hidden_size, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
    weight = (0.05 * torch.randn(num_experts, hidden_size, generator=g)).to(dtype)
    return hidden, weight


# 9-16 tokens only where the small-T kernel's blocks fit one wave of 132 multiprocessors.
GEMM_CASES = ([(t, e, h) for t in (1, 4) for e, h in ((256, 7168), (384, 2056), (72, 264))]
              + [(t, e, h) for t in (9, 16) for e, h in ((256, 7168), (72, 264))]
              + [(3, 77, 264)])  # the 4-token tile, an odd gate: a last block of one expert


@pytest.mark.parametrize("num_tokens,num_experts,hidden_size", GEMM_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_router_gemm_variant_and_orders_change_no_bit(emu, num_tokens, num_experts, hidden_size,
                                                      dtype):
    hidden, weight = _gemm_inputs(num_tokens, num_experts, hidden_size, dtype)
    _configure(emu)
    expected = torch.empty(num_tokens, num_experts)
    assert emu.router_gemm(hidden, weight, expected), "the small-T kernel takes this GEMM"
    torch.testing.assert_close(expected, reference.router_gemm(hidden, weight), rtol=2e-5,
                               atol=2e-5)
    for variant in (0, 1, 2, 3):
        for order, code in ORDERS.items():
            _configure(emu, order=code, gemm=variant, seed=7, pdl=code == 2)
            got = torch.empty(num_tokens, num_experts)
            assert emu.router_gemm(hidden, weight, got)
            _assert_same_bits([got], [expected], f"GEMM variant {variant}, {order} order")
    _configure(emu)


# Kimi-K2's 384 experts at 16 tokens are more blocks than a wave: two kernels then.
FUSED_CASES = [(preset, t) for preset in ("deepseek-v3", "kimi-k2", "deepseek-v4-flash",
                                          "deepseek-v2")
               for t in (1, 3, 8, 16) if (preset, t) != ("kimi-k2", 16)]


def _fused_router(emu, hidden, weight, bias, got, counter, k):
    """The emulated fused_router launcher on a preset's plain routing (k: op_kwargs) into the
    outputs `got` (weights, ids, logits); whether the one launch took the call."""
    return emu.fused_router(hidden, weight, bias, *got, counter, k["num_expert_group"],
                            k["topk_group"], k["topk"], k["renormalize"],
                            k["routed_scaling_factor"], SCORING[k["scoring_func"]], 0, 1.0, None,
                            None, None, None)


@pytest.mark.parametrize("preset,num_tokens", FUSED_CASES)
def test_fused_router_is_the_two_kernels_in_every_variant_and_order(emu, preset, num_tokens):
    """SPEC section 7 on one device: the one launch gives the bits of router_gemm_gpu then
    biased_grouped_topk_gpu, whichever block finishes last, in both ways of counting and with
    either GEMM variant; the completion counter it shares with the next launch is back at zero
    after each; variant 3 routes with the gate's own code (a single token by the whole last
    block). Fused router variant 0 leaves the call to the two kernels."""
    p = PRESETS[preset]
    k = p.op_kwargs()
    hidden, weight = _gemm_inputs(num_tokens, p.num_experts, 1032)
    bias = (2 + 0.05 * torch.randn(p.num_experts)) if p.has_bias else None
    _configure(emu)
    logits = torch.empty(num_tokens, p.num_experts)
    assert emu.router_gemm(hidden, weight, logits)
    expected = (*_route(emu, logits, bias, p), logits)
    counter = torch.zeros(1, dtype=torch.int32)

    def outputs():
        return (torch.empty(num_tokens, k["topk"]),
                torch.empty(num_tokens, k["topk"], dtype=torch.int32),
                torch.empty(num_tokens, p.num_experts))

    def fused(got):
        return _fused_router(emu, hidden, weight, bias, got, counter, k)

    assert not fused(outputs()), "variant 0: the two kernels"
    for gemm in (0, 1):
        for count in (1, 2, 3):
            for order, code in ORDERS.items():
                _configure(emu, order=code, gemm=gemm, fused=count, seed=gemm * 2 + count,
                           pdl=code == 1)
                got = outputs()
                assert fused(got), "one launch takes this call"
                _assert_same_bits(got, expected,
                                  f"GEMM variant {gemm}, fused variant {count}, {order} order")
                assert int(counter) == 0
    _configure(emu)


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("row", ["random", "zeros", "nan", "inf", "twin-experts"])
def test_fused_router_gate_block_is_the_two_kernels_on_ties_and_nan(emu, preset, with_bias, row):
    """Fused router variant 3 at one token: the whole last block ranks a gate's experts in
    parallel. A zero row ties every logit (and, without a bias, every expert and group: the
    lowest ids win), a NaN row leaves every b at -inf, an inf in the input makes logits of
    both infinities and NaN, and twin weight rows give pairs of equal logits; each must give
    the two kernels' bits."""
    p = PRESETS[preset]
    k = p.op_kwargs()
    hidden, weight = _gemm_inputs(1, p.num_experts, 264)
    if row == "zeros":
        hidden.zero_()
    elif row == "nan":
        hidden[0, 7] = float("nan")
    elif row == "inf":
        hidden[0, 3] = float("inf")
    elif row == "twin-experts":
        weight[1::2] = weight[0::2]
    bias = 2 + 0.05 * torch.randn(p.num_experts) if with_bias else None
    if with_bias and row == "twin-experts":
        bias[1::2] = bias[0::2]
    _configure(emu)
    logits = torch.empty(1, p.num_experts)
    assert emu.router_gemm(hidden, weight, logits)
    expected = (*_route(emu, logits, bias, p), logits)
    counter = torch.zeros(1, dtype=torch.int32)
    for order, code in ORDERS.items():
        _configure(emu, order=code, fused=3, seed=code + 11, pdl=code == 1)
        got = (torch.empty(1, k["topk"]), torch.empty(1, k["topk"], dtype=torch.int32),
               torch.empty(1, p.num_experts))
        assert _fused_router(emu, hidden, weight, bias, got, counter, k), \
            "one launch takes this call"
        _assert_same_bits(got, expected, f"fused variant 3, {order} order")
        assert int(counter) == 0
    _configure(emu)


def test_programmatic_launch_is_taken_on_cuda(emu):
    """With PDL on, the CUDA build launches through cudaLaunchKernelEx with the attribute (the
    routing, the GEMM, the fused kernel), and the results are those without it."""
    if emu.programmatic_launches() < 0:
        pytest.skip("HIP has no programmatic dependent launch")
    p = PRESETS["deepseek-v3"]
    logits = 2 * torch.randn(5, p.num_experts)
    bias = 2 + 0.05 * torch.randn(p.num_experts)
    _configure(emu)
    before = emu.programmatic_launches()
    expected = _route(emu, logits, bias, p)
    assert emu.programmatic_launches() == before
    _configure(emu, pdl=True)
    _assert_same_bits(_route(emu, logits, bias, p), expected, "routing with PDL")
    hidden, weight = _gemm_inputs(2, 256, 7168)
    logits = torch.empty(2, 256)
    assert emu.router_gemm(hidden, weight, logits)
    assert emu.programmatic_launches() == before + 2
    _configure(emu)


# The suite's property tests, on the GPU kernels: random topologies (1-16 groups of 1-40
# experts, top-k up to 40), dtypes, transposed logits, NaN, inf and tie rows; and near ties.
# Parametrised rather than a fixture: hypothesis reruns the body, not function-scoped fixtures.
@pytest.mark.parametrize("flavour", EMULATED_GPUS)
@given(problem=routing_problems())
def test_property_matches_reference(flavour, problem):
    logits, bias, args = routing_problem_inputs(problem, "cpu")
    weights, ids = emulated_ops(flavour).biased_grouped_topk(logits, bias, *args)
    assert_routing_matches(weights, ids, logits, bias, *args)


@pytest.mark.parametrize("flavour", EMULATED_GPUS)
@given(problem=near_tie_problems())
def test_property_near_ties_are_valid_choices(flavour, problem):
    logits, bias, kw = near_tie_problem_inputs(problem, "cpu")
    weights, ids = emulated_ops(flavour).biased_grouped_topk(logits, bias, **kw)
    assert_valid_routing(weights, ids, logits, bias, **kw)
