"""A random sweep of the routing ops and the router GEMM against moeext.reference and
against each other.

Not part of the suite (pytest collects only test_*.py): a tool to run for minutes or hours
where the suite's fixed cases and hypothesis properties run for seconds. Each case draws a
topology (1-32 groups, odd sizes, top-k up to 40, or 64 with --big), dtypes of logits and
bias, a scoring function, values (plain, wide enough for subnormal scores, rounded into ties,
huge, tiny, with NaN and inf rows) and strides, then checks:

- biased_grouped_topk against the reference (tests/routing_check.py: ids in order; rows
  whose reference scores tie by rounding coincidence go to the float64 oracle);
- the out= form, into a wider buffer, gives the same bits and writes nothing past its columns;
- routing_weights of the chosen ids gives routing's weights bit for bit (docs/SPEC.md 6.6);
- the section 6 options equal reference.apply_routing_options on the plain result;
- fused_router equals router_gemm then biased_grouped_topk bit for bit, and its out= form;
- router_gemm (any CPU path, odd sizes, strides, a prepacked weight, bf16 logits) within the
  accumulation bound of the exact product, and exact where every sum is (small integers); on
  the CPU, its two gradients within that bound of theirs;
- on the CPU, the logits' gradient through routing's weights and through the replay against
  autograd through the reference at the same ids, within float32's rounding of the terms.

--target cpu draws a CPU path per case and runs it at two thread counts, which must give the
same bits; cuda and hip64 run the GPU kernels on the host
(tests/gpu_emulation/, built under MOEEXT_GPU_EMULATION_BUILD or $TMPDIR), each case with a
random run order, multiprocessor count, PDL mode and kernel variants, and again with the
current kernels, which must give the same bits.

    python tests/sweep_routing.py [--target cpu|cuda|hip64] [--seconds 600] [--seed 1] [--big]

Prints each failing case's seed (rerun it alone with --case SEED) and the counts at the end;
exits 1 if any case failed.
"""

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest  # noqa: E402 (tests/conftest.py)
import moeext  # noqa: E402
from moeext import reference  # noqa: E402
from routing_check import assert_routing_matches, assert_valid_routing  # noqa: E402
from test_router_gemm import assert_close_to_reference  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_bits(a, b):
    """Equal shapes, dtypes and bits (a NaN equals the same NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


class Sweep:
    def __init__(self, ops, emulated, big):
        self.ops = ops
        self.emulated = emulated
        self.big = big
        self.results = []  # what a case computed, for the variants' comparison
        self.description = ""
        self.counts = dict.fromkeys(
            ["plain", "float64_oracle", "out", "replay", "options", "fused", "gemm",
             "gemm_gradient", "gradient"], 0)

    # ---- inputs ------------------------------------------------------------------------------

    @staticmethod
    def generator(rng):
        return torch.Generator().manual_seed(rng.randrange(1 << 30))

    def logits(self, rng, num_tokens, num_experts, dtype):
        g = self.generator(rng)
        shape = (num_tokens, num_experts)
        kind = rng.choice(["plain", "wide", "ties", "huge", "tiny"])
        if kind == "plain":
            x = torch.randn(shape, generator=g) * rng.choice([0.1, 1.0, 3.0])
        elif kind == "wide":  # exp below the normal floats, and softplus past its cut at 20
            x = (torch.rand(shape, generator=g) - 0.5) * 220
        elif kind == "ties":
            x = torch.randint(-3, 4, shape, generator=g).float() * rng.choice([0.25, 1.0, 8.0])
        elif kind == "huge":
            x = torch.randn(shape, generator=g) * 60
        else:
            x = torch.randn(shape, generator=g) * 1e-3
        if num_tokens > 0 and rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                r, e = rng.randrange(num_tokens), rng.randrange(num_experts)
                special = rng.choice(["nan row", "nan", "inf", "-inf", "inf row", "-inf row"])
                value = float(special.split()[0])
                if special.endswith("row"):
                    x[r] = value
                else:
                    x[r, e] = value
        x = x.to(dtype)
        layout = rng.choice(["contiguous", "columns of a wider row", "every other row",
                             "transposed"])
        if layout == "columns of a wider row":
            wide = torch.zeros(num_tokens, num_experts + rng.randint(1, 9), dtype=dtype)
            first = rng.randint(0, wide.shape[1] - num_experts)
            wide[:, first:first + num_experts] = x
            x = wide[:, first:first + num_experts]
        elif layout == "every other row" and num_tokens > 0:
            tall = torch.zeros(2 * num_tokens, num_experts, dtype=dtype)
            tall[::2] = x
            x = tall[::2]
        elif layout == "transposed":
            x = x.t().contiguous().t()
        return x

    def bias(self, rng, num_experts):
        dtype = rng.choice([None] + DTYPES)
        if dtype is None:
            return None
        g = self.generator(rng)
        kind = rng.choice(["small", "ties", "large"])
        if kind == "small":
            b = torch.randn(num_experts, generator=g) * 0.05 + rng.choice([0.0, 2.0])
        elif kind == "ties":
            b = torch.randint(-2, 3, (num_experts,), generator=g).float() * 0.5
        else:
            b = torch.randn(num_experts, generator=g) * 5
        return b.to(dtype)

    def options(self, rng, num_experts, num_tokens, topk):
        g = self.generator(rng)
        options = {}
        shared = rng.choice([0, 0, 1, 2])
        if shared:
            options["num_fused_shared_experts"] = shared
            options["shared_expert_weight"] = rng.choice([1.0, 0.5, 2.5])
        if rng.random() < 0.5:
            options["expert_map"] = torch.randint(-1, 64, (num_experts + shared,), generator=g,
                                                  dtype=torch.int32)
        if rng.random() < 0.5:
            options["expert_counts"] = torch.randint(
                0, 5, (num_experts,), generator=g, dtype=rng.choice([torch.int32, torch.int64]))
        if rng.random() < 0.5:
            options["routed_experts"] = torch.full(
                (num_tokens + rng.randint(0, 3), topk), -3,
                dtype=rng.choice([torch.int16, torch.int32]))
        if rng.random() < 0.4:
            options["num_valid_tokens"] = torch.tensor([rng.randint(-1, num_tokens + 1)],
                                                       dtype=torch.int32)
        return options

    # ---- cases -------------------------------------------------------------------------------

    def routing_case(self, rng):
        ops = self.ops
        groups = rng.choice([1, 1, 2, 3, 4, 5, 8, 8, 16, 32])
        size = (rng.choice([1, 2, 3, 7, 8, 16, 24, 32, 33, 48, 64]) if groups > 1
                else rng.randint(1, 2100 if self.big else 520))
        num_experts = groups * size
        topk_group = rng.randint(1, groups)
        topk = rng.randint(1, min(topk_group * size, 64 if self.big else 40))
        num_tokens = rng.choice([1, 17, 64, 200, 513] if self.big
                                else [0, 1, 1, 2, 3, 5, 16, 17, 33])
        scoring = rng.choice(["sigmoid", "sigmoid", "sqrtsoftplus", "softmax"])
        renormalize = rng.random() < 0.7
        scale = rng.choice([1.0, 2.5, 2.827])
        x = self.logits(rng, num_tokens, num_experts, rng.choice(DTYPES))
        bias = self.bias(rng, num_experts)
        args = (groups, topk_group, topk, renormalize, scale, scoring)
        self.description = (
            f"T={num_tokens} E={num_experts} groups={groups} topk_group={topk_group} "
            f"topk={topk} logits {x.dtype} strides {x.stride()} bias "
            f"{None if bias is None else bias.dtype} {scoring}")

        weights, ids = ops.biased_grouped_topk(x, bias, *args)
        self.results += [weights, ids]
        try:
            assert_routing_matches(weights, ids, x, bias, *args)
        except AssertionError:
            # Equal reference scores from different inputs (a rounding coincidence) are not
            # held to the index rule: the float64 oracle decides those rows.
            assert_valid_routing(weights, ids, x, bias, *args)
            self.counts["float64_oracle"] += 1
        self.counts["plain"] += 1

        extra = rng.randint(0, 3)
        weights_out = torch.full((num_tokens, topk + extra), -7.0)
        ids_out = torch.full((num_tokens, topk + extra), -7, dtype=torch.int32)
        ops.biased_grouped_topk_out(x, bias, weights_out[:, :topk], ids_out[:, :topk], groups,
                                    topk_group, renormalize, scale, scoring)
        assert same_bits(weights_out[:, :topk], weights), "out=: other weights"
        assert same_bits(ids_out[:, :topk], ids), "out=: other ids"
        assert bool((weights_out[:, topk:] == -7).all() and (ids_out[:, topk:] == -7).all()), (
            "out=: wrote past its columns")
        self.counts["out"] += 1

        if num_tokens > 0:
            # A record of any id dtype and layout: a routed_experts buffer's rows, a column
            # slice of a wider one, a transposed copy.
            record = ids.to(rng.choice([torch.int16, torch.int32, torch.int64]))
            layout = rng.choice(["as returned", "columns of a wider record", "transposed"])
            if layout == "columns of a wider record":
                wide = torch.full((num_tokens, topk + 3), -1, dtype=record.dtype)
                wide[:, 1:topk + 1] = record
                record = wide[:, 1:topk + 1]
            elif layout == "transposed":
                record = record.t().contiguous().t()
            replayed = ops.routing_weights(x, record, renormalize, scale, scoring)
            if self.emulated and scoring == "softmax" and groups > 1:
                # SPEC 6.6: the replay's softmax sum follows the layout of a row without
                # groups, which routing with groups may not have used.
                torch.testing.assert_close(replayed, weights, rtol=1e-6, atol=1e-30,
                                           equal_nan=True)
            else:
                assert same_bits(replayed, weights), "routing_weights: not routing's weights"
            self.counts["replay"] += 1

        if rng.random() < 0.6:
            options = self.options(rng, num_experts, num_tokens, topk)
            if options:
                expected_buffers = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                    for k, v in options.items()}
                got = ops.biased_grouped_topk(x, bias, *args, **options)
                self.results += list(got)
                expected = reference.apply_routing_options(weights, ids, num_experts,
                                                           **expected_buffers)
                assert same_bits(got[0], expected[0]) and same_bits(got[1], expected[1]), (
                    f"options {sorted(options)}: not the options applied to plain routing")
                for name in ("expert_counts", "routed_experts"):
                    if name in options:
                        assert same_bits(options[name], expected_buffers[name]), name
                self.counts["options"] += 1

    def fused_case(self, rng):
        ops = self.ops
        groups = rng.choice([1, 2, 4, 8])
        size = rng.choice([1, 3, 8, 16, 32, 48]) if groups > 1 else rng.randint(1, 400)
        num_experts = groups * size
        topk_group = rng.randint(1, groups)
        topk = rng.randint(1, min(topk_group * size, 16))
        num_tokens = rng.choice([1, 3, 9, 16, 17, 100] if self.big
                                else [0, 1, 1, 2, 5, 16, 17, 40])
        hidden_size = rng.choice([8, 64, 1000, 4096] if self.big
                                 else [1, 7, 8, 64, 100, 256, 1000])
        dtype = rng.choice(DTYPES)
        g = self.generator(rng)
        hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype)
        weight = (0.1 * torch.randn(num_experts, hidden_size, generator=g)).to(dtype)
        if num_tokens > 0 and rng.random() < 0.3:
            hidden = hidden.t().contiguous().t()
        # A prepacked weight is a CPU layout: the GPU binding refuses it.
        if not self.emulated and dtype == torch.bfloat16 and rng.random() < 0.5:
            weight = moeext.prepack_router_weight(weight)
        bias = self.bias(rng, num_experts)
        scoring = rng.choice(["sigmoid", "sqrtsoftplus", "softmax"])
        args = (groups, topk_group, topk, rng.random() < 0.7, rng.choice([1.0, 2.5]), scoring)
        self.description = (
            f"fused T={num_tokens} H={hidden_size} E={num_experts} {dtype} weight "
            f"{tuple(weight.shape)} groups={groups} topk_group={topk_group} topk={topk} bias "
            f"{None if bias is None else bias.dtype} {scoring}")

        weights, ids, logits = ops.fused_router(hidden, weight, bias, *args, return_logits=True)
        self.results += [weights, ids, logits]
        assert same_bits(logits, ops.router_gemm(hidden, weight)), "not router_gemm's logits"
        two_calls = ops.biased_grouped_topk(logits, bias, *args)
        assert same_bits(weights, two_calls[0]) and same_bits(ids, two_calls[1]), (
            "not the two calls' routing")
        weights_out = torch.empty(num_tokens, topk)
        ids_out = torch.empty(num_tokens, topk, dtype=torch.int32)
        ops.fused_router_out(hidden, weight, bias, weights_out, ids_out, *args[:2], *args[3:])
        assert same_bits(weights_out, weights) and same_bits(ids_out, ids), "out=: other bits"
        self.counts["fused"] += 1

    def gemm_case(self, rng):
        ops = self.ops
        num_tokens = rng.choice([1, 5, 16, 17, 100, 223, 224, 225, 256, 257, 600] if self.big
                                else [0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 33, 64])
        hidden_size = rng.choice([rng.randint(1, 70), rng.randint(1, 1100),
                                  rng.randint(1, 9000 if self.big else 3000),
                                  rng.choice([128, 1024, 4096, 7168])])
        num_experts = rng.choice([rng.randint(1, 70), rng.randint(1, 1100),
                                  rng.choice([16, 64, 160, 256, 384])])
        dtype = rng.choice(DTYPES)
        out_dtype = rng.choice([None, torch.float32, torch.bfloat16])
        g = self.generator(rng)
        kind = rng.choice(["normal", "integers", "mixed scales"])
        if kind == "normal":
            hidden = torch.randn(num_tokens, hidden_size, generator=g)
            weight = 0.02 * torch.randn(num_experts, hidden_size, generator=g)
        elif kind == "integers":  # exact products and sums: any order gives the exact logits
            hidden = torch.randint(-4, 5, (num_tokens, hidden_size), generator=g).float()
            weight = torch.randint(-4, 5, (num_experts, hidden_size), generator=g).float()
        else:  # columns of very different magnitudes: cancellation at every size
            hidden = torch.randn(num_tokens, hidden_size, generator=g) * torch.exp2(
                torch.randint(-12, 13, (hidden_size,), generator=g).float())
            weight = torch.randn(num_experts, hidden_size, generator=g)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        layout = rng.choice(["contiguous", "rows of a wider buffer", "transposed"])
        if layout == "rows of a wider buffer":
            wide = torch.zeros(num_tokens, hidden_size + rng.randint(1, 9), dtype=dtype)
            wide[:, :hidden_size] = hidden
            hidden = wide[:, :hidden_size]
        elif layout == "transposed":
            hidden = hidden.t().contiguous().t()
        gate = weight
        if not self.emulated and dtype == torch.bfloat16 and rng.random() < 0.4:
            gate = moeext.prepack_router_weight(weight)
        elif rng.random() < 0.3:
            every_other = torch.zeros(num_experts, 2 * hidden_size, dtype=dtype)
            every_other[:, ::2] = weight
            gate = every_other[:, ::2]
        self.description = (
            f"router_gemm T={num_tokens} H={hidden_size} E={num_experts} {dtype} -> "
            f"{out_dtype} {kind} hidden {layout} strides {hidden.stride()} weight "
            f"{tuple(gate.shape)} strides {gate.stride()}")

        logits = ops.router_gemm(hidden, gate, out_dtype)
        self.results.append(logits)
        assert_close_to_reference(logits, hidden, weight, out_dtype)
        if kind == "integers" and out_dtype != torch.bfloat16:
            assert torch.equal(logits.double(), reference.router_gemm(hidden, weight).double()), (
                "an exact sum came out rounded")
        self.counts["gemm"] += 1
        # The emulated ops defer a gradient to the CPU; a prepacked weight has none.
        if (not self.emulated and gate.dim() == 2 and num_tokens > 0 and rng.random() < 0.3
                and not (dtype == torch.float16 and kind == "mixed scales")):
            self.gemm_gradient(hidden, gate, out_dtype, rng)

    def gemm_gradient(self, hidden, weight, out_dtype, rng):
        """router_gemm's gradients, grad @ weight and grad.T @ hidden in float32 rounded once
        to the inputs' dtype, against the exact products of the same upstream gradient."""
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        logits = self.ops.router_gemm(h, w, out_dtype)
        upstream = torch.randn(logits.shape, generator=self.generator(rng)).to(logits.dtype)
        logits.backward(upstream)  # torch's matmuls: their bits may follow the thread count
        up = upstream.double()
        # float32 gradients are the sums themselves; others are rounded once more.
        rtol = 0.0 if h.dtype == torch.float32 else torch.finfo(h.dtype).eps
        spacing = subnormal_spacing(h.dtype)
        for name, got, exact, magnitude, length in (
                ("hidden_states", h.grad, up @ weight.double(),
                 up.abs() @ weight.double().abs(), weight.shape[0]),
                ("weight", w.grad, up.T @ hidden.double(),
                 up.abs().T @ hidden.double().abs(), hidden.shape[0])):
            assert got.dtype == h.dtype and got.shape == exact.shape, f"{name}: gradient's layout"
            tolerance = (4 * max(length, 1) ** 0.5 * 2.0**-24 * magnitude * (1 + rtol)
                         + rtol * exact.abs() + spacing)
            error = (got.double() - exact).abs()
            assert bool((error <= tolerance).all()), (
                f"{name}: gradient off the exact product by {float((error - tolerance).max()):.3g} "
                f"beyond the bound")
        self.counts["gemm_gradient"] += 1

    def gradient_case(self, rng):
        """The logits' gradient through routing's weights and through the replay, against
        autograd through the reference at the same ids."""
        groups = rng.choice([1, 1, 2, 4, 8])
        size = rng.choice([1, 3, 8, 16, 32]) if groups > 1 else rng.randint(1, 300)
        num_experts = groups * size
        topk_group = rng.randint(1, groups)
        topk = rng.randint(1, min(topk_group * size, 16))
        num_tokens = rng.choice([1, 2, 5, 17])
        scoring = rng.choice(["sigmoid", "sqrtsoftplus", "softmax"])
        renormalize = rng.random() < 0.7
        scale = rng.choice([1.0, 2.5])
        dtype = rng.choice(DTYPES)
        x = self.logits(rng, num_tokens, num_experts, dtype)
        bias = self.bias(rng, num_experts)
        upstream = torch.randn(num_tokens, topk, generator=self.generator(rng))
        self.description = (
            f"gradient T={num_tokens} E={num_experts} groups={groups} topk_group={topk_group} "
            f"topk={topk} logits {x.dtype} strides {x.stride()} {scoring} "
            f"renormalize={renormalize}")

        args = (groups, topk_group, topk, renormalize, scale, scoring)
        # With the section 6 options, the routed columns carry the gradient of the plain call
        # at its logical ids; the shared columns are constants.
        options = self.options(rng, num_experts, num_tokens, topk) if rng.random() < 0.4 else {}
        shared = options.get("num_fused_shared_experts", 0)
        shared_upstream = torch.randn(num_tokens, shared, generator=self.generator(rng))
        self.description += f" options {sorted(options)}"
        routed = x.detach().clone().requires_grad_()
        weights, _ = moeext.biased_grouped_topk(routed, bias, *args, **options)
        ids = moeext.biased_grouped_topk(x, bias, *args)[1]
        (weights * torch.cat([upstream, shared_upstream], dim=1)).sum().backward()
        replayed = x.detach().clone().requires_grad_()
        (moeext.routing_weights(replayed, ids, renormalize, scale, scoring)
         * upstream).sum().backward()
        expected_input = x.detach().clone().requires_grad_()
        (reference.routing_weights(expected_input, ids.long(), renormalize, scale, scoring)
         * upstream).sum().backward()
        expected = expected_input.grad.float()
        if scoring != "softmax":
            # SPEC section 1: an expert not chosen gets 0 where the reference's derivative is
            # NaN (its score's derivative times autograd's 0). A softmax couples the whole row:
            # there a NaN reaches every expert in both.
            chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
            chosen.scatter_(1, ids.long(), True)
            expected = torch.where(torch.isnan(expected) & ~chosen, 0.0, expected)
        # Both compute in float32 and round once to the logits' dtype. The renormalisation's
        # and the softmax's terms can cancel, and a score below the normal floats keeps few
        # bits: each side is within many float32 ulps of the terms' size and a few of the
        # smallest float32 times the factor the score multiplies.
        terms, sensitivity = gradient_terms(x, ids, upstream, renormalize, scale, scoring)
        rtol = torch.finfo(dtype).eps
        tolerance = (rtol * expected.abs().double() + 2.0**-14 * terms
                     + 8 * subnormal_spacing(torch.float32) * sensitivity
                     + 4 * subnormal_spacing(dtype))
        self.results += [routed.grad, replayed.grad]
        for name, got in (("routing", routed.grad), ("replay", replayed.grad)):
            assert got.dtype == dtype, f"{name}: gradient in {got.dtype}"
            error = (got.double() - expected.double()).abs()
            bad = ~((error <= tolerance) | (got.float() == expected)
                    | (torch.isnan(got.float()) & torch.isnan(expected)))
            assert not bool(bad.any()), (
                f"{name}: gradient {got.float()[bad][:4].tolist()} where autograd through the "
                f"reference gives {expected[bad][:4].tolist()} (terms of "
                f"{terms[bad][:4].tolist()})")
        self.counts["gradient"] += 1

    def case(self, seed):
        self.description = ""
        rng = random.Random(seed)
        draw = rng.random()
        if draw < 0.6:
            self.routing_case(rng)
        elif draw < 0.75:
            self.fused_case(rng)
        elif draw < 0.9 or self.emulated:  # a gradient runs on the CPU: emulated ops defer
            self.gemm_case(rng)
        else:
            self.gradient_case(rng)


def subnormal_spacing(dtype):
    """The distance between neighbouring subnormals of a floating dtype (its smallest step)."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def gradient_terms(x, ids, upstream, renormalize, scale, scoring):
    """Per logit, float64: the size of the terms whose sum is its derivative through routing's
    weights, and how much the derivative moves per unit of the scores (or the score's
    derivative) it is made of: what a float32 computation's rounding, and a score below the
    normal floats, are relative to. A NaN score counts as 0."""
    x = x.double()
    if scoring == "softmax":
        s = torch.softmax(x, dim=-1)
    elif scoring == "sigmoid":
        s = torch.sigmoid(x)
        derivative = s * (1 - s)
    else:
        s = torch.sqrt(F.softplus(x))
        derivative = torch.where(x < -20, 0.5 * torch.exp(0.5 * x), torch.sigmoid(x) / (2 * s))
    s = torch.where(torch.isnan(s), 0.0, s)
    if scoring != "softmax":
        derivative = torch.where(torch.isnan(derivative), 0.0, derivative)
    chosen = s.gather(1, ids.long())
    up = upstream.double().abs() * abs(scale)
    if renormalize:
        total = chosen.sum(dim=1, keepdim=True) + 1e-20
        g = up / total + (up * chosen).sum(dim=1, keepdim=True) / total**2
    else:
        g = up
    by_score = torch.zeros_like(x).scatter_(1, ids.long(), g)  # bounds |d loss / d score|
    if scoring == "softmax":  # d / d x_j = p_j (g_j - sum_i g_i p_i), g_i = d loss / d p_i
        factor = by_score + (by_score * s).sum(dim=1, keepdim=True)
        return s * factor, factor + s * by_score.sum(dim=1, keepdim=True)
    return derivative * by_score, by_score


def emulated_module(flavour):
    """The suite's build of the GPU kernels for the host (conftest.py) and its ops."""
    module = conftest.emulation_file("prepare").load(conftest.emulation_build_root(), flavour)
    return module, conftest.emulation_file("ops").EmulatedOps(module)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["cpu", "cuda", "hip64"], default="cpu")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--big", action="store_true",
                        help="up to 513 tokens, 2100 experts, top-64, H = 4096 (slow emulated)")
    parser.add_argument("--case", type=int, default=None, help="run this case's seed alone")
    args = parser.parse_args(argv)

    module = None
    if args.target == "cpu":
        sweep = Sweep(moeext, emulated=False, big=args.big)
        cpu_paths = moeext.build_info()["cpu_isas_available"]
    else:
        module, ops = emulated_module(args.target)
        sweep = Sweep(ops, emulated=True, big=args.big)
        cpu_paths = [moeext.cpu_isa()]  # the checks' and the CPU fallbacks' path
    rng = random.Random(args.seed)
    failures, cases, repeated = 0, 0, 0
    end = time.time() + args.seconds
    while time.time() < end:
        seed = args.case if args.case is not None else rng.randrange(1 << 30)
        # Where the case runs comes from its seed too, so that --case repeats all of it.
        where_rng = random.Random(seed + 1)
        moeext.set_cpu_isa(where_rng.choice(cpu_paths))
        where = f"cpu path {moeext.cpu_isa()}"
        again = None  # what the case's second run changes, and what differing bits mean
        if module is not None:
            # run order, its seed, multiprocessors, routing / GEMM / fused variant, PDL
            setting = (where_rng.randrange(3), where_rng.randrange(1 << 30),
                       where_rng.choice([1, 3, 132]), where_rng.randrange(3),
                       where_rng.randrange(2), where_rng.randrange(3), where_rng.random() < 0.5)
            module.configure(*setting)
            where = f"{args.target} {setting}"
            if setting[3:6] != (0, 0, 0):
                again = (lambda: module.configure(*setting[:3], 0, 0, 0, setting[6]),
                         "the variants' bits differ from the current kernels'")
        else:
            threads = where_rng.sample([1, 2, 3], 2)
            torch.set_num_threads(threads[0])
            where += f", {threads[0]} threads, then {threads[1]}"
            again = (lambda: torch.set_num_threads(threads[1]),
                     f"{threads[1]} threads give other bits than {threads[0]}")
        try:
            sweep.results = []
            sweep.case(seed)
            if again is not None:
                first_results, counts = sweep.results, dict(sweep.counts)
                again[0]()
                sweep.results = []
                sweep.case(seed)
                sweep.counts = counts
                assert len(first_results) == len(sweep.results) and all(
                    same_bits(a, b) for a, b in zip(first_results, sweep.results)), again[1]
                repeated += 1
        except Exception as e:  # noqa: BLE001 (every failure is reported, the sweep goes on)
            failures += 1
            print(f"FAIL --case {seed}{' --big' if args.big else ''} ({where}) "
                  f"{sweep.description}: {str(e)[:800]}", flush=True)
            if failures <= 3:
                traceback.print_exc(limit=4)
            if failures >= 30:
                break
        cases += 1
        if args.case is not None:
            break
    print(f"{cases} cases ({args.target}{', big' if args.big else ''}), {failures} failed; "
          f"{sweep.counts}, " + (f"variants equal to the current kernels in {repeated}"
                                 if module is not None
                                 else f"the same bits at another thread count in {repeated}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
