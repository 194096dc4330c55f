"""What only a GPU run can show, for every op: CUDA-graph capture and replay, the current stream
of the input's device, a second GPU, and inputs on two devices.

Each op is a case below: ``make(seed)`` draws its tensor inputs on the CPU (plain dtypes; ``run``
views them as fp4/E8M0 where the op should see those), ``run(t)`` calls the op on tensors ``t``
on the GPU, and ``check(new, t, outputs)`` compares the outputs (and in-place buffers) with the
reference computed on the CPU from ``new``, the values ``t`` holds.

- Graphs: warm up on a side stream, capture one call into a ``torch.cuda.CUDAGraph`` reading
  static inputs, then for several new values copy them into the static inputs, replay,
  synchronise and check. A kernel that bakes an input value into the launch (the extent held in
  ``state``, say) or synchronises with the host fails here.
- Streams: on a fresh non-default stream of the input's device, the GPU sleeps and then
  overwrites the inputs with new values; the op is called right after, with the current device
  set to another GPU when there is one. Only that stream is synchronised before checking, so
  the results are right only if the op queued its work on the current stream of the input's
  device (an op on the default stream, or on the current device's stream, reads the old inputs
  or is not finished).

Runs per GPU in ``conftest.GPU_DEVICES`` ("cuda", and "cuda:1" on a second GPU).
"""

import random
import re

import pytest
import torch

import moeext
from conftest import GPU_DEVICES, switched
from moeext import reference
from moeext.presets import PRESETS
from routing_check import assert_routing_matches, assert_same_bits
from test_router_gemm import assert_close_to_reference

pytestmark = pytest.mark.skipif(
    not GPU_DEVICES,
    reason="CUDA graphs and streams need a GPU and a moeext build with the cuda backend "
           "(torch.cuda.is_available() and 'cuda' in moeext.build_info()['backends'])")

# About 50-100 ms on current GPUs: far longer than it takes the host to queue the op.
SLEEP_CYCLES = 1 << 27


@pytest.fixture(params=GPU_DEVICES)
def gpu(request):
    """One GPU as a torch.device with its index spelled out ("cuda" is the current one)."""
    device = torch.device(request.param)
    return torch.device("cuda", torch.cuda.current_device() if device.index is None
                        else device.index)


def _other_gpu(gpu):
    """A GPU other than ``gpu`` if there is one, else ``gpu``."""
    if torch.cuda.device_count() < 2:
        return gpu
    return torch.device("cuda", 1 if gpu.index == 0 else 0)


def _to(tensors, device):
    return {name: t.to(device) for name, t in tensors.items()}


def _cpu_bytes(t):
    """t's bytes on the CPU (1-byte dtypes move as uint8: no fp4/fp8 copy kernel needed)."""
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.uint8)
    return raw.cpu()


def _assert_same_bytes(got, expected):
    assert got.shape == expected.shape
    assert torch.equal(_cpu_bytes(got), _cpu_bytes(expected))


def _capture(fn, device, warmup=3):
    """Warms ``fn`` up on a side stream, then captures one call; returns (graph, its outputs).

    The capture stream is made on ``device``: torch.cuda.graph's default one lives on whichever
    device was current at its first use.
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            outputs = fn()
    return graph, outputs


# ---------------------------------------------------------------------------------------
# One case per op (and per variant worth its own graph).
# ---------------------------------------------------------------------------------------

class Routing:
    """biased_grouped_topk; odd seeds end in all-NaN rows, as CUDA-graph padding rows are."""

    num_tokens = 64

    def __init__(self, preset):
        self.preset = PRESETS[preset]
        self.name = f"biased_grouped_topk-{preset}"

    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        logits = 2 * torch.randn(self.num_tokens, self.preset.num_experts, generator=g)
        if seed % 2:
            logits[-5:] = float("nan")
        inputs = {"logits": logits.bfloat16()}
        if self.preset.has_bias:
            inputs["bias"] = 2 + 0.05 * torch.randn(self.preset.num_experts, generator=g)
        return inputs

    def run(self, t):
        return moeext.biased_grouped_topk(t["logits"], t.get("bias"), **self.preset.op_kwargs())

    def check(self, new, t, outputs):
        weights, ids = outputs
        assert weights.device == ids.device == t["logits"].device
        assert_routing_matches(weights, ids, new["logits"], new.get("bias"),
                               **self.preset.op_kwargs())


class RoutingOut(Routing):
    """biased_grouped_topk_out into the first topk columns of wider persistent buffers."""

    extra = 2  # columns that hold something else (shared experts) and must stay as they are

    def __init__(self):
        super().__init__("deepseek-v3")
        self.name = "biased_grouped_topk_out-slice"
        self.topk = self.preset.topk

    def make(self, seed):
        inputs = super().make(seed)
        shape = (self.num_tokens, self.topk + self.extra)
        inputs["weights_buf"] = torch.full(shape, -7.0)
        inputs["ids_buf"] = torch.full(shape, -7, dtype=torch.int32)
        return inputs

    def run(self, t):
        p = self.preset
        moeext.biased_grouped_topk_out(t["logits"], t["bias"], t["weights_buf"][:, :self.topk],
                                       t["ids_buf"][:, :self.topk], p.num_expert_group,
                                       p.topk_group, p.renormalize, p.routed_scaling_factor,
                                       p.scoring_func)
        return ()

    def check(self, new, t, outputs):
        weights_buf, ids_buf = t["weights_buf"].cpu(), t["ids_buf"].cpu()
        assert bool((weights_buf[:, self.topk:] == -7.0).all())
        assert bool((ids_buf[:, self.topk:] == -7).all())
        assert_routing_matches(weights_buf[:, :self.topk], ids_buf[:, :self.topk],
                               new["logits"], new["bias"], **self.preset.op_kwargs())


class RoutingOptions(Routing):
    """biased_grouped_topk with every option of docs/SPEC.md section 6; the valid-row count
    changes from replay to replay (read from device memory when the graph runs; -3 counts no
    row), so the rows recorded and counted follow it."""

    valid_by_seed = (64, 40, 0, 64, -3, 17)

    def __init__(self, preset):
        super().__init__(preset)
        self.name = f"biased_grouped_topk-options-{preset}"
        p = self.preset
        g = torch.Generator().manual_seed(5)
        self.map = torch.randperm(p.num_experts + 1, generator=g).to(torch.int32)
        self.counts_before = None

    def make(self, seed):
        inputs = super().make(seed)
        p = self.preset
        valid = self.valid_by_seed[seed % len(self.valid_by_seed)]
        inputs["valid"] = torch.tensor([valid], dtype=torch.int32)
        inputs["counts"] = torch.full((p.num_experts,), 3, dtype=torch.int64)
        inputs["record"] = torch.full((self.num_tokens + 4, p.topk), -1, dtype=torch.int16)
        inputs["map"] = self.map
        return inputs

    def run(self, t):
        return moeext.biased_grouped_topk(
            t["logits"], t.get("bias"), **self.preset.op_kwargs(), num_fused_shared_experts=1,
            shared_expert_weight=0.5, expert_map=t["map"], expert_counts=t["counts"],
            routed_experts=t["record"], num_valid_tokens=t["valid"])

    def check(self, new, t, outputs):
        p = self.preset
        weights, ids = (o.cpu() for o in outputs)
        valid = min(max(int(new["valid"]), 0), self.num_tokens)
        record = t["record"].cpu()
        logical = record[:valid].int()
        assert bool((record[valid:] == -1).all())
        assert_routing_matches(weights[:valid, :p.topk], logical, new["logits"][:valid],
                               new.get("bias"), **p.op_kwargs())
        assert torch.equal(ids[:valid], self.map[torch.cat(
            [logical.long(), torch.full((valid, 1), p.num_experts)], dim=1)])
        assert bool((weights[:, p.topk] == 0.5).all())
        counts = torch.full((p.num_experts,), 3) + torch.bincount(
            logical.reshape(-1).long(), minlength=p.num_experts)
        assert torch.equal(t["counts"].cpu(), counts)


class RoutingReplay:
    """routing_weights of recorded ids, bit for bit the weights routing gave them."""

    name = "routing_weights"

    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        p = PRESETS["deepseek-v3"]
        logits = (2 * torch.randn(32, p.num_experts, generator=g)).bfloat16()
        ids = torch.stack([torch.randperm(p.num_experts, generator=g)[:p.topk]
                           for _ in range(32)]).to(torch.int16)
        return {"logits": logits, "ids": ids}

    def run(self, t):
        return (moeext.routing_weights(t["logits"], t["ids"], True, 2.5, "sigmoid"),)

    def check(self, new, t, outputs):
        (weights,) = outputs
        torch.testing.assert_close(weights.cpu(), reference.routing_weights(
            new["logits"], new["ids"], True, 2.5, "sigmoid"), rtol=2e-5, atol=1e-6)


class RouterGemm:
    """router_gemm at DeepSeek-V3's gate shape, decode-sized."""

    def __init__(self, out_dtype):
        self.out_dtype = out_dtype
        self.name = f"router_gemm-{str(out_dtype).removeprefix('torch.')}"

    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        return {"hidden": torch.randn(16, 7168, generator=g).bfloat16(),
                "weight": (0.02 * torch.randn(256, 7168, generator=g)).bfloat16()}

    def run(self, t):
        return (moeext.router_gemm(t["hidden"], t["weight"], self.out_dtype),)

    def check(self, new, t, outputs):
        (logits,) = outputs
        assert logits.device == t["hidden"].device
        assert_close_to_reference(logits.cpu(), new["hidden"], new["weight"], self.out_dtype)


class FusedRouter:
    """fused_router at a model's gate, decode-sized, bit for bit the two calls it fuses, run
    on the GPU on the replay's inputs; with the options, the count and record buffers too.
    ``fused_variant`` (moeext::gpu_fused_router_variant) is set while the graph is captured:
    0 the two kernels, 1 the one launch (its completion counter must be back at zero for every
    replay), 3 the one launch with the gate's own routing (a single token by the whole last
    block)."""

    def __init__(self, preset, num_tokens, options=False, fused_variant=1):
        self.preset = PRESETS[preset]
        self.num_tokens = num_tokens
        self.options = options
        self.fused_variant = fused_variant
        self.name = (f"fused_router-{preset}-T{num_tokens}" + ("-options" if options else "")
                     + ("-two-kernels" if fused_variant == 0 else "-one-launch")
                     + ("" if fused_variant in (0, 1) else f"-variant{fused_variant}"))

    def make(self, seed):
        p = self.preset
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(self.num_tokens, 7168, generator=g)
        if seed % 2:
            hidden[-1] = float("nan")
        inputs = {"hidden": hidden.bfloat16(),
                  "weight": (0.02 * torch.randn(p.num_experts, 7168, generator=g)).bfloat16(),
                  "bias": 2 + 0.05 * torch.randn(p.num_experts, generator=g)}
        if self.options:
            inputs["valid"] = torch.tensor([self.num_tokens - seed % 2], dtype=torch.int64)
            inputs["counts"] = torch.full((p.num_experts,), seed, dtype=torch.int32)
            inputs["record"] = torch.full((self.num_tokens, p.topk), -1, dtype=torch.int32)
        return inputs

    def _options(self, t):
        if not self.options:
            return {}
        return dict(num_fused_shared_experts=1, expert_counts=t["counts"],
                    routed_experts=t["record"], num_valid_tokens=t["valid"])

    def run(self, t):
        with switched(moeext._C._set_gpu_fused_router_variant, self.fused_variant):
            return moeext.fused_router(t["hidden"], t["weight"], t["bias"],
                                       **self.preset.op_kwargs(), **self._options(t),
                                       return_logits=True)

    def check(self, new, t, outputs):
        expected_buffers = {name: new[name].to(t["hidden"].device) for name in new}
        logits = moeext.router_gemm(expected_buffers["hidden"], expected_buffers["weight"])
        expected = moeext.biased_grouped_topk(logits, expected_buffers["bias"],
                                              **self.preset.op_kwargs(),
                                              **self._options(expected_buffers))
        for got, want in zip(outputs, (*expected, logits)):
            assert got.device == want.device
            assert_same_bits(got, want)
        for name in ("counts", "record") if self.options else ():
            assert torch.equal(t[name], expected_buffers[name])


def _nonzero_bytes(shape, g):
    return torch.randint(1, 256, shape, dtype=torch.uint8, generator=g)


class ZeroTail:
    """zero_tail_ of a packed fp4 buffer (rows 10..39 of 50)."""

    name = "zero_tail_"

    def make(self, seed):
        return {"buf": _nonzero_bytes((50, 24), torch.Generator().manual_seed(seed))}

    def run(self, t):
        moeext.zero_tail_(t["buf"].view(torch.float4_e2m1fn_x2), 10, 40)
        return ()

    def check(self, new, t, outputs):
        expected = new["buf"].clone()
        reference.zero_tail_(expected, 10, 40)
        assert torch.equal(t["buf"].cpu(), expected)


class ZeroTailTracked:
    """zero_tail_tracked_: the previous extent is whatever ``state`` holds when the op runs
    (past the 50 rows: clamped; negative: read as 0)."""

    name = "zero_tail_tracked_"
    previous_extents = (40, 25, 50, -5, 80)  # by seed

    def make(self, seed):
        g = torch.Generator().manual_seed(seed)
        prev = self.previous_extents[seed % len(self.previous_extents)]
        return {"buf": torch.randint(1, 1000, (50, 3), dtype=torch.int32, generator=g),
                "state": torch.tensor([prev], dtype=torch.int64)}

    def run(self, t):
        moeext.zero_tail_tracked_(t["buf"], t["state"], 10)
        return ()

    def check(self, new, t, outputs):
        buf, state = new["buf"].clone(), new["state"].clone()
        reference.zero_tail_tracked_(buf, state, 10)
        assert torch.equal(t["buf"].cpu(), buf)
        assert torch.equal(t["state"].cpu(), state)


class ShuffleWeight:
    """shuffle_weight (or unshuffle_weight) of [2, 64, 128] fp4 pairs or bf16 elements."""

    def __init__(self, dtype, gate_up, inverse=False):
        self.dtype, self.gate_up, self.inverse = dtype, gate_up, inverse
        op = "unshuffle_weight" if inverse else "shuffle_weight"
        self.name = f"{op}-{str(dtype).removeprefix('torch.')}{'-gate_up' if gate_up else ''}"

    def make(self, seed):
        return {"w": _nonzero_bytes((2, 64, 128 * self.dtype.itemsize),
                                    torch.Generator().manual_seed(seed))}

    def run(self, t):
        op = moeext.unshuffle_weight if self.inverse else moeext.shuffle_weight
        return (op(t["w"].view(self.dtype), gate_up=self.gate_up),)

    def check(self, new, t, outputs):
        (out,) = outputs
        assert out.device == t["w"].device and out.dtype == self.dtype
        ref = reference.unshuffle_weight if self.inverse else reference.shuffle_weight
        _assert_same_bytes(out, ref(new["w"].view(self.dtype), gate_up=self.gate_up))


class E8m0Shuffle:
    """e8m0_shuffle of E8M0 scales: padded [300, 9], or gate_up over 4 experts of 64 rows."""

    def __init__(self, gate_up):
        self.gate_up = gate_up
        self.shape, self.num_experts = ((256, 20), 4) if gate_up else ((300, 9), None)
        self.name = "e8m0_shuffle" + ("-gate_up" if gate_up else "-padded")

    def make(self, seed):
        return {"scale": _nonzero_bytes(self.shape, torch.Generator().manual_seed(seed))}

    def run(self, t):
        return (moeext.e8m0_shuffle(t["scale"].view(torch.float8_e8m0fnu), self.gate_up,
                                    self.num_experts),)

    def check(self, new, t, outputs):
        (out,) = outputs
        assert out.device == t["scale"].device and out.dtype == torch.float8_e8m0fnu
        _assert_same_bytes(out, reference.e8m0_shuffle(new["scale"], self.gate_up,
                                                       self.num_experts))


class E8m0Unshuffle:
    """e8m0_unshuffle back to [300, 9] from the padded [512, 16]."""

    name = "e8m0_unshuffle"

    def make(self, seed):
        return {"shuffled": _nonzero_bytes((512, 16), torch.Generator().manual_seed(seed))}

    def run(self, t):
        return (moeext.e8m0_unshuffle(t["shuffled"].view(torch.float8_e8m0fnu), 300, 9),)

    def check(self, new, t, outputs):
        (out,) = outputs
        assert out.device == t["shuffled"].device and out.dtype == torch.float8_e8m0fnu
        _assert_same_bytes(out, reference.e8m0_unshuffle(new["shuffled"], 300, 9))


CASES = [
    Routing("deepseek-v3"), Routing("kimi-k2"), Routing("deepseek-v4-flash"),
    Routing("deepseek-v2"), RoutingOut(),
    RoutingOptions("deepseek-v3"), RoutingOptions("kimi-k2"), RoutingReplay(),
    RouterGemm(torch.float32), RouterGemm(torch.bfloat16),
    FusedRouter("deepseek-v3", 1), FusedRouter("deepseek-v3", 16, options=True),
    FusedRouter("kimi-k2", 3), FusedRouter("kimi-k2", 16),
    FusedRouter("deepseek-v3", 1, fused_variant=0),
    FusedRouter("deepseek-v3", 16, options=True, fused_variant=0),
    FusedRouter("deepseek-v3", 1, fused_variant=3), FusedRouter("kimi-k2", 1, fused_variant=3),
    FusedRouter("kimi-k2", 3, fused_variant=3),
    ZeroTail(), ZeroTailTracked(),
    ShuffleWeight(torch.float4_e2m1fn_x2, gate_up=True), ShuffleWeight(torch.bfloat16, False),
    ShuffleWeight(torch.float4_e2m1fn_x2, gate_up=True, inverse=True),
    ShuffleWeight(torch.bfloat16, gate_up=False, inverse=True),
    E8m0Shuffle(gate_up=False), E8m0Shuffle(gate_up=True), E8m0Unshuffle(),
]
_CASE_IDS = [c.name for c in CASES]


# ---------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=_CASE_IDS)
def test_graph_replays_follow_new_inputs(gpu, case):
    static = _to(case.make(0), gpu)
    graph, outputs = _capture(lambda: case.run(static), gpu)
    with torch.cuda.device(gpu):
        for seed in (1, 2, 3, 4):
            new = case.make(seed)
            for name, t in static.items():
                t.copy_(new[name])
            graph.replay()
            torch.cuda.synchronize(gpu)
            case.check(new, static, outputs)


def test_zero_tail_tracked_graphs_follow_the_state_across_extents(gpu):
    """One graph per batch size, as engines capture them, replayed in any order.

    Each replay reads the previous extent from ``state`` in device memory, whichever graph ran
    last, so the buffer always equals a full fill_(0) followed by this step's rows. 70 is past
    the 64 rows: clamped when zeroing, stored as it is.
    """
    rows, extents = 64, (0, 1, 8, 17, 64, 70)
    buf = torch.zeros(rows, 3, dtype=torch.int32, device=gpu)
    state = torch.zeros(1, dtype=torch.int64, device=gpu)
    payload = torch.zeros(rows, 3, dtype=torch.int32, device=gpu)  # every graph's static input

    def step(n):
        moeext.zero_tail_tracked_(buf, state, n)
        buf[:n].copy_(payload[:n])

    graphs = {n: _capture(lambda n=n: step(n), gpu)[0] for n in extents}
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    order = [64, 8, 70, 0, 17, 1, 1, 64, 17] + [rng.choice(extents) for _ in range(40)]
    with torch.cuda.device(gpu):
        buf.zero_()  # zeroed buffer and state 0, as the op's contract starts
        state.zero_()
        for i, n in enumerate(order):
            new = torch.randint(1, 1000, (rows, 3), dtype=torch.int32, generator=g)
            payload.copy_(new)
            graphs[n].replay()
            torch.cuda.synchronize(gpu)
            expected = torch.zeros(rows, 3, dtype=torch.int32)
            expected[:n] = new[:n]
            assert torch.equal(buf.cpu(), expected), f"replay {i}: extents {order[:i + 1]}"
            assert int(state.item()) == n


# ---------------------------------------------------------------------------------------
# Streams and devices
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=_CASE_IDS)
def test_runs_on_the_current_stream_of_the_input_device(gpu, case):
    inputs = _to(case.make(1), gpu)  # what the inputs hold before the stream rewrites them
    staged = _to(case.make(2), gpu)  # what it writes, staged on the GPU: a device-side copy
    torch.cuda.synchronize(gpu)
    stream = torch.cuda.Stream(gpu)
    with torch.cuda.device(gpu), torch.cuda.stream(stream):  # gpu's current stream: stream
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current device's current stream
        for name, t in inputs.items():
            t.copy_(staged[name])
        with torch.cuda.device(_other_gpu(gpu)):  # gpu's current stream is still stream
            outputs = case.run(inputs)
    stream.synchronize()
    case.check(case.make(2), inputs, outputs)


def test_inputs_on_two_devices_are_rejected(gpu):
    """All tensors of one call on one device; a clear error naming both, and nothing written."""
    logits = torch.randn(4, 64, device=gpu)
    weights = torch.full((4, 8), -3.0, device=gpu)
    ids = torch.full((4, 8), -3, dtype=torch.int32, device=gpu)
    elsewhere = [torch.device("cpu")] + ([_other_gpu(gpu)] if _other_gpu(gpu) != gpu else [])
    for other in elsewhere:
        message = re.escape(f"correction_bias is on {other} but gating_output is on {gpu}")
        bias = torch.zeros(64, device=other)
        with pytest.raises(RuntimeError, match=message):
            moeext.biased_grouped_topk(logits, bias, 8, 4, 8)
        with pytest.raises(RuntimeError, match=message):
            moeext.biased_grouped_topk_out(logits, bias, weights, ids, 8, 4)
        assert bool((weights == -3.0).all()) and bool((ids == -3).all())

        other_weights = torch.full((4, 8), -3.0, device=other)
        with pytest.raises(RuntimeError, match=re.escape(
                f"topk_weights is on {other} but gating_output is on {gpu}")):
            moeext.biased_grouped_topk_out(logits, None, other_weights, ids, 8, 4)
        assert bool((other_weights == -3.0).all()) and bool((ids == -3).all())

        with pytest.raises(RuntimeError, match=re.escape(
                f"weight is on {other} but hidden_states is on {gpu}")):
            moeext.router_gemm(logits.bfloat16(), torch.zeros(3, 64, dtype=torch.bfloat16,
                                                              device=other))

        buf = torch.ones(8, 2, dtype=torch.int32, device=gpu)
        state = torch.tensor([8], dtype=torch.int64, device=other)
        with pytest.raises(RuntimeError, match=re.escape(
                f"state is on {other} but buf is on {gpu}")):
            moeext.zero_tail_tracked_(buf, state, 2)
        assert bool((buf == 1).all()) and int(state) == 8
