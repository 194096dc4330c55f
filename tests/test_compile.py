"""torch.library.opcheck and torch.compile(fullgraph=True) for every op."""

import pytest
import torch

import moeext
from child_process import run_in_child_process
from moeext.presets import PRESETS


def _routing_inputs(num_tokens, device, logits_dtype=torch.bfloat16, bias_dtype=torch.float32):
    g = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 256, generator=g).to(logits_dtype).to(device)
    bias = (2 + 0.05 * torch.randn(256, generator=g)).to(bias_dtype).to(device)
    return logits, bias


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("num_tokens", [0, 1, 33])
def test_opcheck_biased_grouped_topk(device, num_tokens, with_bias):
    logits, bias = _routing_inputs(num_tokens, device)
    bias = bias if with_bias else None
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk.default,
                          (logits, bias, 8, 4, 8, True, 2.5, "sigmoid"))
    weights = torch.empty(num_tokens, 10, device=device)[:, :8]
    ids = torch.empty(num_tokens, 10, dtype=torch.int32, device=device)[:, :8]
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk_out.default,
                          (logits, bias, weights, ids, 8, 4, True, 2.5, "sqrtsoftplus"))


@pytest.mark.parametrize("scoring_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_opcheck_biased_grouped_topk_with_gradient(device, scoring_func):
    # Logits that require grad take the autograd kernel: opcheck also checks its registration
    # and the backward traced by AOTAutograd against eager.
    logits, bias = _routing_inputs(13, device, logits_dtype=torch.float32)
    logits.requires_grad_()
    torch.library.opcheck(torch.ops.moeext.biased_grouped_topk.default,
                          (logits, bias, 8, 4, 8, True, 2.5, scoring_func))


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2", "deepseek-v4-pro"])
def test_compile_fullgraph_dynamic_tokens(device, preset):
    torch._dynamo.reset()
    p = PRESETS[preset]

    def route(logits, bias):
        # Some surrounding work, as in a model's forward, so the op sits inside a graph.
        weights, ids = moeext.biased_grouped_topk(logits * 1.0, bias, **p.op_kwargs())
        return weights * 2, ids

    compiled = torch.compile(route, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17, 64, 1):
        g = torch.Generator().manual_seed(num_tokens)
        logits = torch.randn(num_tokens, p.num_experts, generator=g).bfloat16().to(device)
        bias = torch.randn(p.num_experts, generator=g).to(device) if p.has_bias else None
        expected = route(logits, bias)
        got = compiled(logits, bias)
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0])


def test_compile_out_form_into_persistent_buffer(device):
    torch._dynamo.reset()
    weights_buf = torch.zeros(64, 9, device=device)
    ids_buf = torch.zeros(64, 9, dtype=torch.int32, device=device)

    def route(logits, bias):
        n = logits.shape[0]
        moeext.biased_grouped_topk_out(logits, bias, weights_buf[:n, :8], ids_buf[:n, :8], 8, 4,
                                       True, 2.5)
        return weights_buf[:n, :8].sum(-1)

    compiled = torch.compile(route, fullgraph=True, dynamic=True)
    logits, bias = _routing_inputs(20, device)
    total = compiled(logits, bias)
    expected_w, expected_ids = moeext.biased_grouped_topk(logits, bias, 8, 4, 8, True, 2.5)
    assert torch.equal(ids_buf[:20, :8], expected_ids)
    torch.testing.assert_close(total, expected_w.sum(-1))
    assert bool((weights_buf[:, 8] == 0).all()) and bool((ids_buf[20:] == 0).all())


def test_compile_out_form_with_an_unbacked_batch(device):
    # A batch size the graph cannot guard on (data-dependent, as after a nonzero()): the fake
    # must check the outputs' sizes without guarding on them.
    torch._dynamo.reset()

    def route(logits, weights, ids):
        moeext.biased_grouped_topk_out(logits, None, weights, ids, 8, 4)
        return weights * 1, ids + 0

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    logits, _ = _routing_inputs(5, device)
    weights = torch.zeros(5, 8, device=device)
    ids = torch.zeros(5, 8, dtype=torch.int32, device=device)
    for t in (logits, weights, ids):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    got_weights, got_ids = compiled(logits, weights, ids)
    expected_weights, expected_ids = moeext.biased_grouped_topk(logits, None, 8, 4, 8)
    assert torch.equal(got_ids, expected_ids)
    assert torch.equal(got_weights, expected_weights)


def test_fake_rejects_what_the_kernel_rejects():  # meta tensors only: no device to vary
    logits = torch.empty(4, 64, device="meta")
    with pytest.raises(RuntimeError, match=r"topk \(33\) exceeds the experts"):
        moeext.biased_grouped_topk(logits, None, 8, 4, 33)
    weights, ids = moeext.biased_grouped_topk(logits, torch.empty(64, device="meta"), 8, 4, 8)
    assert weights.shape == (4, 8) and weights.dtype == torch.float32
    assert ids.shape == (4, 8) and ids.dtype == torch.int32


def _mixed_device_calls():
    cpu = dict(device="cpu")
    gpu = dict(device="cuda")  # a fake tensor's device: no GPU is needed
    logits, weights = torch.empty(4, 64, **cpu), torch.empty(4, 8, **cpu)
    return [
        (lambda: torch.ops.moeext.biased_grouped_topk(
            logits, torch.empty(64, **gpu), 8, 4, 8, True, 1.0, "sigmoid"),
         "biased_grouped_topk: correction_bias is on cuda:0 but gating_output is on cpu"),
        (lambda: torch.ops.moeext.biased_grouped_topk_out(
            logits, None, weights, torch.empty(4, 8, dtype=torch.int32, **gpu), 8, 4, True,
            1.0, "sigmoid"),
         "biased_grouped_topk_out: topk_ids is on cuda:0 but gating_output is on cpu"),
        (lambda: torch.ops.moeext.router_gemm(torch.empty(2, 16, **cpu),
                                              torch.empty(8, 16, **gpu), None),
         "router_gemm: weight is on cuda:0 but hidden_states is on cpu"),
        (lambda: torch.ops.moeext.zero_tail_tracked_(
            torch.empty(8, 4, **cpu), torch.zeros(1, dtype=torch.int64, **gpu), 2),
         "zero_tail_tracked_: state is on cuda:0 but buf is on cpu"),
    ]


def test_fakes_reject_mixed_devices():
    # Fake tensors carry any device, so the fakes' device checks run on a CPU-only machine.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for call, message in _mixed_device_calls():
            with pytest.raises(RuntimeError, match=message):
                call()


@pytest.mark.parametrize("device_of_call", ["cpu", "meta"])  # the kernel, then the fake
def test_fake_and_kernel_reject_a_size_or_rank_alike(device_of_call):
    # More experts than int32 ids hold: an expanded row, so nothing is allocated.
    logits = torch.zeros(1, 1, device=device_of_call).expand(2, 2**31)
    with pytest.raises(RuntimeError, match="num_experts must fit int32 expert ids, got 2147483648"):
        moeext.biased_grouped_topk(logits, None, 1, 1, 1)
    logits = torch.zeros(3, 16, device=device_of_call)
    flat_weights = torch.zeros(6, device=device_of_call)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=device_of_call)
    message = r"topk_weights must be 2-D \[num_tokens, topk\], got 1-D"
    with pytest.raises(RuntimeError, match=message):
        moeext.biased_grouped_topk_out(logits, None, flat_weights, ids, 1, 1)


def test_opcheck_zero_tail(device):
    for dtype in (torch.int32, torch.bfloat16, torch.uint8):
        buf = torch.ones(12, 3, device=device).to(dtype)
        torch.library.opcheck(torch.ops.moeext.zero_tail_.default, (buf, 2, 9))
        torch.library.opcheck(torch.ops.moeext.zero_tail_.default, (buf, 9, 2))
        state = torch.tensor([11], dtype=torch.int64, device=device)
        torch.library.opcheck(torch.ops.moeext.zero_tail_tracked_.default, (buf, state, 4))
    # A value of a graph: the zeroing is recorded for the backward.
    buf = torch.randn(12, 3, device=device, requires_grad=True) * 2
    torch.library.opcheck(torch.ops.moeext.zero_tail_.default, (buf, 2, 9))


def test_compile_zero_tail(device):
    torch._dynamo.reset()
    buf = torch.ones(32, 4, dtype=torch.int32, device=device)
    state = torch.tensor([32], dtype=torch.int64, device=device)

    def step(n, values):
        moeext.zero_tail_tracked_(buf, state, n)
        buf[:n] = values
        moeext.zero_tail_(buf, n, n)  # no-op
        return buf.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (20, 5, 9):
        total = compiled(n, torch.full((n, 4), 2, dtype=torch.int32, device=device))
        assert int(state) == n
        assert int(total) == 8 * n and int(buf[n:].count_nonzero()) == 0


def test_compile_zero_tail_keeps_the_extent_symbolic(device):
    # The extent is a batch size: one graph must serve every batch, as it does for the
    # routing op (an int schema argument specialised the graph and recompiled per size).
    torch._dynamo.reset()
    buf = torch.ones(32, 4, dtype=torch.int32, device=device)
    state = torch.tensor([32], dtype=torch.int64, device=device)

    def step(values):
        n = values.shape[0]
        moeext.zero_tail_tracked_(buf, state, n)
        moeext.zero_tail_(buf, n, 32)
        buf[:n] = values
        return buf.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    compiled(torch.full((20, 4), 2, dtype=torch.int32, device=device))
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (5, 9, 31):
            total = compiled(torch.full((n, 4), 2, dtype=torch.int32, device=device))
            assert int(state) == n
            assert int(total) == 8 * n and int(buf[n:].count_nonzero()) == 0


class _RoutingStep(torch.nn.Module):
    """A gate, then its ids kept in a persistent buffer whose tail is zeroed as batches shrink."""

    def __init__(self, device):
        super().__init__()
        self.router = moeext.nn.GroupedTopKRouter.from_preset("deepseek-v3", 64, device=device)
        self.register_buffer("ids", torch.zeros(32, 8, dtype=torch.int32, device=device))
        self.register_buffer("extent", torch.zeros(1, dtype=torch.int64, device=device))

    def forward(self, hidden):
        n = hidden.shape[0]
        weights, ids = self.router(hidden)
        moeext.zero_tail_tracked_(self.ids, self.extent, n)
        self.ids[:n] = ids
        return weights


def _export_routing_step(step, device):
    batch = torch.export.Dim("batch", min=1, max=32)
    with torch.no_grad():
        return torch.export.export(step, (torch.randn(5, 64, device=device).bfloat16(),),
                                   dynamic_shapes=({0: batch},))


def _check_routing_steps(run, router, ids, device):
    """Batches of 7 then 3 tokens: weights as eager, ids in the buffer, its tail zeroed."""
    for n in (7, 3):
        hidden = torch.randn(n, 64, device=device).bfloat16()
        with torch.no_grad():
            weights = run(hidden)
            expected_weights, expected_ids = router(hidden)
        torch.testing.assert_close(weights, expected_weights)
        assert torch.equal(ids[:n], expected_ids) and not ids[n:].any()


def test_export_with_a_dynamic_batch(device):
    step = _RoutingStep(device)
    module = _export_routing_step(step, device).module()
    _check_routing_steps(module, step.router, dict(module.named_buffers())["ids"], device)


def _aot_inductor_package_check(device, package_path):
    step = _RoutingStep(device)
    step.ids.fill_(7)
    step.extent.fill_(32)
    with torch.no_grad():
        package = torch._inductor.aoti_compile_and_package(
            _export_routing_step(step, device), package_path=package_path)
    runner = torch._inductor.aoti_load_package(package)
    runner.load_constants(dict(step.state_dict(keep_vars=True)), check_full_update=True,
                          user_managed=True)
    _check_routing_steps(runner, step.router, step.ids, device)
    assert int(step.extent) == 3


def test_aot_inductor_package_with_a_dynamic_batch(device, tmp_path):
    # The deployment path after torch.export: AOTInductor compiles the program into a package
    # whose generated code reaches the moeext ops through the dispatcher. Its buffers are
    # handed in as the caller's own tensors, so the tail zeroing is seen where a server's
    # persistent buffer would be. In a child process: loading the package on an H200
    # (torch 2.11.0+cu130) died with SIGSEGV and took the whole run down with it.
    run_in_child_process("the AOTInductor package", _aot_inductor_package_check, device,
                         str(tmp_path / "step.pt2"))


def test_compile_zero_tail_gradient(device):
    torch._dynamo.reset()

    def loss(x, n, w):
        y = x * 2
        moeext.zero_tail_(y, n, 9)
        return (y * w).sum()  # not y * y: its gradient in the zeroed rows is 0 either way

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for n in (3, 5, 10):
        x = torch.randn(12, 4, device=device, requires_grad=True)
        w = torch.randn(12, 4, device=device)
        expected = torch.autograd.grad(loss(x, n, w), x)[0]
        got = torch.autograd.grad(compiled(x, n, w), x)[0]
        assert not got[n:9].any() and bool(got[:n].ne(0).all() and got[max(n, 9):].ne(0).all())
        torch.testing.assert_close(got, expected)


def test_opcheck_shuffles(device):
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (2, 32, 64), dtype=torch.uint8, generator=g).to(device)
    for gate_up in (False, True):
        torch.library.opcheck(torch.ops.moeext.shuffle_weight.default, (w, [16, 16], gate_up))
        torch.library.opcheck(torch.ops.moeext.unshuffle_weight.default, (w, [16, 16], gate_up))
    bf16 = torch.randn(2, 32, 64, generator=g).bfloat16().to(device)
    torch.library.opcheck(torch.ops.moeext.shuffle_weight.default, (bf16, [16, 16], False))
    # With a gradient (the inverse move), compiled against eager.
    for op in (torch.ops.moeext.shuffle_weight, torch.ops.moeext.unshuffle_weight):
        torch.library.opcheck(op.default, (bf16.clone().requires_grad_(), [16, 16], True))
    s = torch.randint(0, 256, (64, 12), dtype=torch.uint8, generator=g).to(device)
    torch.library.opcheck(torch.ops.moeext.e8m0_shuffle.default, (s, True, 2))
    shuffled = moeext.e8m0_shuffle(s)
    torch.library.opcheck(torch.ops.moeext.e8m0_unshuffle.default, (shuffled, 64, 12, False, None))


def test_compile_shuffles(device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)

    def prepare(w, s):
        return (moeext.shuffle_weight(w, (16, 16), gate_up=True),
                moeext.e8m0_shuffle(s, gate_up=True, num_experts=w.shape[0]))

    compiled = torch.compile(prepare, fullgraph=True, dynamic=True)
    for experts in (2, 3):
        w = torch.randint(0, 256, (experts, 64, 32), dtype=torch.uint8, generator=g).to(device)
        s = torch.randint(0, 256, (experts * 64, 1), dtype=torch.uint8, generator=g).to(device)
        got, expected = compiled(w, s), prepare(w, s)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 33])
def test_opcheck_router_gemm(device, num_tokens, out_dtype):
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, 2 * 1000, generator=g).bfloat16().to(device)
    # Strided rows, except for T = 0: opcheck cannot rebuild a strided view of 0 rows.
    hidden = hidden[:, :1000] if num_tokens else torch.empty(0, 1000, dtype=torch.bfloat16,
                                                             device=device)
    weight = (0.02 * torch.randn(7, 1000, generator=g)).bfloat16().to(device)
    torch.library.opcheck(torch.ops.moeext.router_gemm.default, (hidden, weight, out_dtype))
    torch.library.opcheck(torch.ops.moeext.router_gemm.default,
                          (hidden.float(), weight.float()))
    if hidden.device.type == "cpu":
        torch.library.opcheck(torch.ops.moeext.router_gemm.default,
                              (hidden, moeext.prepack_router_weight(weight.cpu()), out_dtype))
    # With a gradient (opcheck compares the compiled backward with the eager one).
    torch.library.opcheck(torch.ops.moeext.router_gemm.default,
                          (hidden.float().requires_grad_(), weight.float().requires_grad_()))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_compile_router_gemm_then_routing(device, out_dtype):
    """The gate as an engine runs it: GEMM, then routing on its logits, in one graph."""
    torch._dynamo.reset()
    p = PRESETS["deepseek-v3"]
    g = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(p.num_experts, 512, generator=g)).bfloat16().to(device)
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)).to(device)

    def gate(hidden):
        logits = moeext.router_gemm(hidden, weight, out_dtype)
        return moeext.biased_grouped_topk(logits, bias, **p.op_kwargs()) + (logits,)

    compiled = torch.compile(gate, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17, 1):
        hidden = torch.randn(num_tokens, 512, generator=g).bfloat16().to(device)
        expected = gate(hidden)
        got = compiled(hidden)
        assert got[2].dtype == out_dtype and got[2].shape == (num_tokens, p.num_experts)
        assert torch.equal(got[2], expected[2])
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0])


def test_compile_gradient_through_the_gate(device):
    """A trained gate: the routing weights' gradient reaches the router weight and the hidden
    states through router_gemm, compiled as eagerly."""
    torch._dynamo.reset()
    p = PRESETS["deepseek-v3"]
    g = torch.Generator().manual_seed(1)
    bias = (2 + 0.05 * torch.randn(p.num_experts, generator=g)).to(device)

    def loss(hidden, weight, grad_weights):
        logits = moeext.router_gemm(hidden, weight)
        weights, _ = moeext.biased_grouped_topk(logits, bias, **p.op_kwargs())
        return (weights * grad_weights).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for num_tokens in (3, 17):
        hidden = torch.randn(num_tokens, 96, generator=g).to(device).requires_grad_()
        weight = (0.1 * torch.randn(p.num_experts, 96, generator=g)).to(device).requires_grad_()
        grad_weights = torch.randn(num_tokens, p.topk, generator=g).to(device)
        expected = torch.autograd.grad(loss(hidden, weight, grad_weights), (hidden, weight))
        got = torch.autograd.grad(compiled(hidden, weight, grad_weights), (hidden, weight))
        assert bool(got[1].ne(0).any())
        torch.testing.assert_close(got, expected)


def test_compile_router_gemm_with_a_prepacked_weight():
    """A prepacked weight (CPU) traces like the nn.Linear layout: output [T, E], dynamic T."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    weight = (0.02 * torch.randn(70, 513, generator=g)).bfloat16()
    packed = moeext.prepack_router_weight(weight)
    compiled = torch.compile(lambda h: moeext.router_gemm(h, packed), fullgraph=True,
                             dynamic=True)
    for num_tokens in (3, 17, 1):
        hidden = torch.randn(num_tokens, 513, generator=g).bfloat16()
        got = compiled(hidden)
        assert got.shape == (num_tokens, 70) and got.dtype == torch.float32
        assert torch.equal(got, moeext.router_gemm(hidden, packed))


def test_compile_fullgraph_gradient(device):
    torch._dynamo.reset()
    p = PRESETS["deepseek-v3"]

    def loss(logits, bias, grad_weights):
        weights, _ = moeext.biased_grouped_topk(logits * 1.0, bias, **p.op_kwargs())
        return (weights * grad_weights).sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for num_tokens in (5, 21):
        logits, bias = _routing_inputs(num_tokens, device, logits_dtype=torch.float32)
        grad_weights = torch.randn(num_tokens, p.topk, device=device)
        expected = torch.autograd.grad(loss(logits.requires_grad_(), bias, grad_weights), logits)
        got = torch.autograd.grad(compiled(logits, bias, grad_weights), logits)
        torch.testing.assert_close(got, expected)
