#!/usr/bin/env python3
"""moeext.fused_router against the engines' router GEMM + routing pairs, on one GPU (issue #53).

The rows the shared peer comparison (shared/gpu-peers) does not have: the gate of DeepSeek-V3
and of Kimi-K2 (H = 7168, bf16 hidden states and gate, fp32 correction bias) for T = 1 ... 16,
timed as that harness times its rows and with its own machinery, imported from the copy the
GPU session carries (``.gpu-peers/``): the peers it built (``load_peers``), its callers of
each engine's router GEMM and routing kernel, ``graph_us`` (N calls back to back in one CUDA
graph, every call its own gate weight, so that the weights come from memory as a model's
layers do), its smallest-kernel floor and its case lists. Rows:

  fused           moeext.fused_router as calls run it (moeext::gpu_fused_router_variant 0: the
                  two kernels, in one call)
  one launch      the same with the one-launch kernel, which these sizes take: fused router
                  variant 3 (--one-launch-variant): the gate's own routing in the last block,
                  a single token by all its threads, more by the gate's own warp instance
  moeext PDL      fused_router (as calls run it, and its one launch), router_gemm and
                  biased_grouped_topk launched with programmatic dependent launch (where
                  the device runs it), for the mode-for-mode rows
                  against vLLM's GEMM and FlashInfer's routing, which launch with it
  moeext          router_gemm then biased_grouped_topk, captured back to back, and the sum of
                  the two timed alone
  peer pairs      every built peer router GEMM (vLLM, FlashInfer, cuBLAS) followed by every
                  built peer routing kernel (vLLM, SGLang, FlashInfer with and without PDL) on
                  the GEMM's fp32 logits: captured back to back (what a model runs), and the
                  sum of the two kernels timed alone

Targets (issue #53): the fused op at most 3.0 us at T = 1, and at most 0.7x the best pair
(vLLM GEMM + FlashInfer routing in the baseline run) at every T <= 16, both presets. The
fused results must equal the two moeext calls bit for bit (torch.equal); each pair's ids are
compared with moeext's as the harness compares routing: rows whose expert sets differ, and
rows with the same set in another order, and the weights matched by id.

Run from the checkout root, after .gpu-peers/device_run.sh built moeext in place and the
peers into ./build-peers (PEER_BUILD moves it):

    python benchmarks/python/bench_fused_router_peers.py [--peers .gpu-peers] [--moeext python]
        [--out $OUT] [--quick] [--presets deepseek-v3,kimi-k2] [--one-launch-variant 3]
        [--dry-run]
"""

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

T1_LIMIT_US = 3.0
PAIR_RATIO_LIMIT = 0.7
REFERENCE_PAIR = "vllm+flashinfer"  # the best pair of the 2026-11-28 baseline run
N_CALLS = 64  # one gate weight per call: 64 x 3.7 MB (E = 256) is four times the H200's L2
# moeext::gpu_fused_router_variant of the "one launch" rows, unless --one-launch-variant says.
DEFAULT_ONE_LAUNCH_VARIANT = 3


def load_harness(peers_dir):
    """The shared harness's bench_peers module, from the folder the GPU session copied it to."""
    peers_dir = Path(peers_dir).resolve()
    if not (peers_dir / "bench_peers.py").exists():
        raise SystemExit(f"--peers: no bench_peers.py in {peers_dir} (copy ../shared/gpu-peers "
                         "there, as its README says)")
    sys.path.insert(0, str(peers_dir))
    return importlib.import_module("bench_peers")


def cases(harness, quick, presets=None):
    """(preset, tokens): the harness's routing presets at the token counts of its router-GEMM
    cases for that preset's expert count."""
    out = []
    for preset, spec in harness.ROUTING.items():
        if presets and preset not in presets:
            continue
        out += [(preset, t) for e, t in harness.gemm_cases(quick) if e == spec[0]]
    return out


def check_presets(harness, presets):
    """The harness's routing constants must be moeext's presets (it checks the same)."""
    for name, (e, g, tg, k, s) in harness.ROUTING.items():
        p = presets[name]
        got = (p.num_experts, p.num_expert_group, p.topk_group, p.topk, p.routed_scaling_factor,
               p.scoring_func, p.renormalize)
        if got != (e, g, tg, k, s, "sigmoid", True):
            raise SystemExit(f"harness ROUTING[{name!r}] = {(e, g, tg, k, s)} is not moeext's "
                             f"preset {got}")


# ----------------------------------------------------------------------------- verdicts
def best_pair(pairs):
    """Name of the pair with the least back-to-back time, among those that were timed."""
    timed = {n: p["graph_us"] for n, p in pairs.items() if p.get("graph_us") is not None}
    return min(timed, key=timed.get) if timed else None


def verdicts(tokens, fused_us, best_us):
    """The issue's two targets for one row: None where a target does not apply or a time is
    missing, else whether it is met."""
    t1 = None
    if tokens == 1 and fused_us is not None:
        t1 = fused_us <= T1_LIMIT_US
    ratio = None
    if fused_us is not None and best_us:
        ratio = fused_us / best_us
    ratio_met = None if ratio is None or tokens > 16 else fused_us <= PAIR_RATIO_LIMIT * best_us
    return {"t1_met": t1, "ratio": ratio, "ratio_met": ratio_met}


def _fmt(v, spec=".2f"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _mark(met):
    return "-" if met is None else ("met" if met else "**missed**")


def summary_lines(rows):
    """Per preset: each target met or missed over the rows that have it."""
    lines = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        t1 = [r for r in mine if r["verdict"]["t1_met"] is not None]
        ratio = [r for r in mine if r["verdict"]["ratio_met"] is not None]
        parts = []
        if t1:
            r = t1[0]
            parts.append(f"{T1_LIMIT_US} us at T=1: {_mark(r['verdict']['t1_met'])} "
                         f"({_fmt(r['fused_us'])} us)")
        else:
            parts.append(f"{T1_LIMIT_US} us at T=1: not measured")
        if ratio:
            missed = [r["tokens"] for r in ratio if not r["verdict"]["ratio_met"]]
            parts.append(f"{PAIR_RATIO_LIMIT}x the best pair at every T <= 16: "
                         + ("met" if not missed else
                            "**missed** at T=" + ", ".join(map(str, missed)))
                         + f" ({len(ratio) - len(missed)} of {len(ratio)} rows met)")
        else:
            parts.append(f"{PAIR_RATIO_LIMIT}x the best pair: no pair timed")
        unequal = [r["tokens"] for r in mine
                   if r.get("fused_equal") is not True or r.get("one_launch_equal") is not True]
        if unequal:
            parts.append("fused NOT equal to the two calls at T=" + ", ".join(map(str, unequal)))
        lines.append(f"- {preset}: " + "; ".join(parts))
    return lines


def markdown(rows, env):
    """The report: targets, the pairs, the checks."""
    lines = [f"# moeext.fused_router against the engines' pairs on {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}; smallest kernel "
             f"{_fmt(env.get('floor_us'))} us. Graph-replay device time per call (median of 5 "
             f"replays of {N_CALLS} calls, each its own gate weight), us. Targets (issue #53): "
             f"fused <= {T1_LIMIT_US} us at T=1 and <= {PAIR_RATIO_LIMIT}x the best pair "
             "(back to back) at every T <= 16. One launch: fused router variant "
             f"{env.get('one_launch_variant', '?')}.", "",
             "Peers: " + ", ".join(f"{k}: {v}" for k, v in env.get("peers", {}).items()), "",
             "## Verdicts", ""] + summary_lines(rows)
    head = ["case", "fused", "one launch", "moeext 2 calls", "moeext sum", "best pair",
            "best pair, back to back", "best pair, sum", f"{REFERENCE_PAIR}, back to back",
            "fused / best", f"fused / {REFERENCE_PAIR}", f"<= {T1_LIMIT_US} us at T=1",
            f"<= {PAIR_RATIO_LIMIT}x best"]
    lines += ["", "## Fused router, moeext's two calls and the best pair (us)", "",
              "| " + " | ".join(head) + " |", "|---|" + "---:|" * 4 + "---|" + "---:|" * 5
              + "---|---|"]
    for r in rows:
        best = r.get("best_pair")
        bp = r["pairs"].get(best, {}) if best else {}
        ref = r["pairs"].get(REFERENCE_PAIR, {})
        ref_ratio = (r["fused_us"] / ref["graph_us"]
                     if r.get("fused_us") is not None and ref.get("graph_us") else None)
        equal = r.get("fused_equal") is True and r.get("one_launch_equal") is True
        cells = [r["case"] + ("" if equal else " (fused MISMATCH)"),
                 _fmt(r.get("fused_us")), _fmt(r.get("one_launch_us")),
                 _fmt(r.get("moeext_two_calls_us")),
                 _fmt(r.get("moeext_sum_us")), best or "-", _fmt(bp.get("graph_us")),
                 _fmt(bp.get("sum_us")), _fmt(ref.get("graph_us")),
                 _fmt(r["verdict"]["ratio"]), _fmt(ref_ratio), _mark(r["verdict"]["t1_met"]),
                 _mark(r["verdict"]["ratio_met"])]
        lines.append("| " + " | ".join(cells) + " |")
    eager = [r for r in rows if r.get("fused_eager_us") is not None]
    if eager:
        lines += ["", "Eager wall time per call at T=1 (host launch included; a pair's call also "
                  "makes its routing closure, as the logits are new each call), us:", "",
                  f"| case | fused | moeext 2 calls | {REFERENCE_PAIR} | best pair |",
                  "|---|---:|---:|---:|---:|"]
        for r in eager:
            best = r.get("best_pair")
            lines.append("| " + " | ".join([
                r["case"], _fmt(r["fused_eager_us"]), _fmt(r.get("moeext_two_calls_eager_us")),
                _fmt(r["pairs"].get(REFERENCE_PAIR, {}).get("eager_us")),
                _fmt(r["pairs"].get(best, {}).get("eager_us") if best else None)]) + " |")
    lines += ["", "## Every pair (us; ids against moeext's two calls on the same inputs)", "",
              "| case | GEMM + routing | back to back | sum of the two | GEMM alone | "
              "routing alone | rows, other expert set | rows, same set in another order | "
              "max weight diff | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        for name, p in r["pairs"].items():
            lines.append("| " + " | ".join([
                r["case"], name, _fmt(p.get("graph_us")), _fmt(p.get("sum_us")),
                _fmt(p.get("gemm_us")), _fmt(p.get("routing_us")),
                _fmt(p.get("rows_differing_ids"), "d"), _fmt(p.get("rows_differing_order"), "d"),
                _fmt(p.get("max_weight_diff"), ".3g"), p.get("note", "")]) + " |")
    pdl = [r for r in rows if r.get("pdl_fused_us") is not None]
    if pdl:
        lines += ["", "## moeext with PDL, mode for mode (us; vLLM's router GEMM and FlashInfer's "
                  "routing launch with it)", "",
                  "| case | fused | one launch | router_gemm | vllm GEMM | moeext / vllm | "
                  "routing | flashinfer routing | moeext / flashinfer |", "|---|" + "---:|" * 8]
        for r in pdl:
            ref = r["pairs"].get(REFERENCE_PAIR, {})
            gemm, routing = ref.get("gemm_us"), ref.get("routing_us")
            lines.append("| " + " | ".join([
                r["case"], _fmt(r["pdl_fused_us"]), _fmt(r.get("pdl_one_launch_us")),
                _fmt(r["pdl_gemm_us"]), _fmt(gemm),
                _fmt(r["pdl_gemm_us"] / gemm if gemm else None), _fmt(r["pdl_routing_us"]),
                _fmt(routing), _fmt(r["pdl_routing_us"] / routing if routing else None)])
                + " |")
    notes = [f"- {r['case']}: {n}" for r in rows for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measuring
def compare_pair(harness, ref, got):
    """(rows whose id sets differ, rows with the same set in another order, max weight diff),
    the first and last as the harness's compare_routing counts them."""
    bad, wdiff = harness.compare_routing(ref, got)
    ref_ids, ids = ref[1].long(), got[1].long()
    same_set = (ref_ids.sort(dim=1).values == ids.sort(dim=1).values).all(dim=1)
    reordered = same_set & (ref_ids != ids).any(dim=1)
    return bad, int(reordered.sum()), wdiff


def measure_case(harness, moeext, status, has_out_dtype, preset, tokens, one_launch_variant):
    import torch
    num_experts, groups, topk_group, topk, scale = harness.ROUTING[preset]
    hidden = harness.HIDDEN
    case = f"{preset} H={hidden} T={tokens}"
    row = {"preset": preset, "tokens": tokens, "case": case, "pairs": {}, "notes": []}
    gen = torch.Generator(device="cuda").manual_seed(num_experts * 100 + tokens)
    sets = [(torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16(),
             (0.02 * torch.randn(num_experts, hidden, device="cuda", generator=gen)).bfloat16(),
             0.5 * torch.randn(num_experts, device="cuda", generator=gen))
            for _ in range(N_CALLS)]
    route = (groups, topk_group, topk, True, scale, "sigmoid")

    def two_calls(x, w, b):
        return moeext.biased_grouped_topk(moeext.router_gemm(x, w), b, *route)

    def one_launch(x, w, b):
        previous = moeext._C._set_gpu_fused_router_variant(one_launch_variant)
        try:
            return moeext.fused_router(x, w, b, *route)
        finally:
            moeext._C._set_gpu_fused_router_variant(previous)

    def equal_to(results, refs):
        return all(torch.equal(f[0], r[0]) and torch.equal(f[1], r[1]) and f[2] is None
                   for f, r in zip(results, refs))

    refs = [two_calls(x, w, b) for x, w, b in sets]
    row["fused_equal"] = equal_to([moeext.fused_router(x, w, b, *route) for x, w, b in sets],
                                  refs)
    row["one_launch_equal"] = equal_to([one_launch(x, w, b) for x, w, b in sets], refs)
    ref = (torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]))
    logits = [moeext.router_gemm(x, w) for x, w, _ in sets]

    fused = [lambda x=x, w=w, b=b: moeext.fused_router(x, w, b, *route) for x, w, b in sets]
    ours = [lambda x=x, w=w, b=b: two_calls(x, w, b) for x, w, b in sets]

    def each_kernel_us():
        """moeext's router GEMM and routing, each timed alone."""
        return (harness.graph_us([lambda x=x, w=w: moeext.router_gemm(x, w)
                                  for x, w, _ in sets], N_CALLS),
                harness.graph_us([lambda y=y, b=b: moeext.biased_grouped_topk(y, b, *route)
                                  for y, (_, _, b) in zip(logits, sets)], N_CALLS))

    row["fused_us"] = harness.graph_us(fused, N_CALLS)
    launched_once = [lambda x=x, w=w, b=b: one_launch(x, w, b) for x, w, b in sets]
    row["one_launch_us"] = harness.graph_us(launched_once, N_CALLS)
    row["moeext_two_calls_us"] = harness.graph_us(ours, N_CALLS)
    row["moeext_gemm_us"], row["moeext_routing_us"] = each_kernel_us()
    row["moeext_sum_us"] = row["moeext_gemm_us"] + row["moeext_routing_us"]
    if moeext._C.programmatic_dependent_launch_supported():
        previous = moeext.set_programmatic_dependent_launch(True)
        try:  # the mode is read at capture: graphs captured here keep it
            row["pdl_fused_us"] = harness.graph_us(fused, N_CALLS)
            row["pdl_one_launch_us"] = harness.graph_us(launched_once, N_CALLS)
            row["pdl_gemm_us"], row["pdl_routing_us"] = each_kernel_us()
        finally:
            moeext.set_programmatic_dependent_launch(previous)
    if tokens == 1:
        row["fused_eager_us"] = harness.eager_us(fused)
        row["moeext_two_calls_eager_us"] = harness.eager_us(ours)

    gemms = harness.gemm_callers(num_experts, status, has_out_dtype)
    routings = harness.routing_callers(preset, "float32", status)
    gemm_alone, routing_alone = {}, {}
    for name, (make, _) in gemms.items():
        try:
            gemm_alone[name] = harness.graph_us([make(x, w) for x, w, _ in sets], N_CALLS)
        except Exception as exc:  # noqa: BLE001 -- one peer's failure must not end the run
            row["notes"].append(f"{name} GEMM alone: {type(exc).__name__}: {str(exc)[:200]}")
    for name, (make, _) in routings.items():
        try:
            routing_alone[name] = harness.graph_us(
                [make(y, b) for y, (_, _, b) in zip(logits, sets)], N_CALLS)
        except Exception as exc:  # noqa: BLE001
            row["notes"].append(f"{name} routing alone: {type(exc).__name__}: {str(exc)[:200]}")
    if not gemms or not routings:
        row["notes"].append(f"no pair: GEMM peers {sorted(gemms)}, routing peers "
                            f"{sorted(routings)}")

    for gname, (gmake, gnote) in gemms.items():
        for rname, (rmake, rnote) in routings.items():
            name = f"{gname}+{rname}"
            pair = {"gemm": gname, "routing": rname,
                    "note": "; ".join(n for n in (gnote, rnote) if n)}
            try:
                # The routing call is made inside each call so that it reads the logits the
                # GEMM allocated in that same call, as a model's forward does.
                calls = [lambda g=gmake(x, w), b=b, rmake=rmake: rmake(g(), b)()
                         for x, w, b in sets]
                outs = [c() for c in calls]
                got = (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]))
                (pair["rows_differing_ids"], pair["rows_differing_order"],
                 pair["max_weight_diff"]) = compare_pair(harness, ref, got)
                pair["graph_us"] = harness.graph_us(calls, N_CALLS)
                if gname in gemm_alone and rname in routing_alone:
                    pair["gemm_us"] = gemm_alone[gname]
                    pair["routing_us"] = routing_alone[rname]
                    pair["sum_us"] = gemm_alone[gname] + routing_alone[rname]
                if tokens == 1:
                    pair["eager_us"] = harness.eager_us(calls)
            except Exception as exc:  # noqa: BLE001
                pair["note"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            row["pairs"][name] = pair
    del sets, logits
    row["best_pair"] = best_pair(row["pairs"])
    best_us = row["pairs"][row["best_pair"]]["graph_us"] if row["best_pair"] else None
    row["verdict"] = verdicts(tokens, row["fused_us"], best_us)
    return row


def summary_line(row):
    best = row["best_pair"]
    best_us = row["pairs"][best]["graph_us"] if best else None
    return (f"{row['case']:28s} fused {_fmt(row['fused_us']):>6s} us  moeext 2 calls "
            f"{_fmt(row['moeext_two_calls_us']):>6s}  best pair {best or '-'} "
            f"{_fmt(best_us)} us  ratio {_fmt(row['verdict']['ratio'])}  "
            f"equal {row['fused_equal']}")


def dry_run(args, harness):
    print(f"harness: {Path(harness.__file__).resolve()}")
    print(f"moeext path: {args.moeext}  out: {args.out}  quick: {args.quick}  one launch: "
          f"fused router variant {args.one_launch_variant}")
    todo = cases(harness, args.quick, args.presets)
    print(f"cases ({len(todo)}), H={harness.HIDDEN}, {N_CALLS} calls per graph:")
    for preset, tokens in todo:
        print(f"   {preset} T={tokens}")
    print(f"pairs: GEMM {harness.GEMM_PEERS} x routing {harness.ROUTING_PEERS} (those built); "
          f"reference pair {REFERENCE_PAIR}")
    print(f"targets: fused <= {T1_LIMIT_US} us at T=1, <= {PAIR_RATIO_LIMIT}x the best pair")
    for name, spec in harness.PEERS.items():
        missing = [s.name for s in spec["sources"] if not s.exists()]
        print(f"peer {name:28s} sources {'ok' if not missing else 'MISSING ' + str(missing)}, "
              f"library {'built' if harness.library_path(name) else 'not built'}")
    sys.path.insert(0, str(Path(args.moeext).resolve()))
    try:
        import moeext
        from moeext.presets import PRESETS
    except Exception as exc:  # noqa: BLE001
        print(f"moeext not importable here ({type(exc).__name__}: {exc}); fine for --dry-run")
        return
    check_presets(harness, PRESETS)
    print(f"moeext importable from {Path(moeext.__file__).parent}; presets match the harness")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default=".gpu-peers",
                        help="the copy of shared/gpu-peers to import bench_peers.py from")
    parser.add_argument("--moeext", default="python",
                        help="directory to put on sys.path to import moeext (built in place)")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"),
                        help="output directory for fused_router_peers.md/.json (default $OUT)")
    parser.add_argument("--quick", action="store_true", help="the harness's quick token counts")
    parser.add_argument("--presets", default=None, type=lambda s: s.split(","),
                        help="comma-separated subset of deepseek-v3,kimi-k2")
    parser.add_argument("--one-launch-variant", type=int, default=DEFAULT_ONE_LAUNCH_VARIANT,
                        choices=[1, 2, 3],
                        help="moeext::gpu_fused_router_variant of the one-launch rows")
    parser.add_argument("--dry-run", action="store_true",
                        help="import the harness and moeext, list the cases; no CUDA")
    args = parser.parse_args(argv)
    harness = load_harness(args.peers)
    if args.presets:
        unknown = sorted(set(args.presets) - set(harness.ROUTING))
        if unknown:
            raise SystemExit(f"--presets: unknown {unknown}; the harness has "
                             f"{sorted(harness.ROUTING)}")
    if args.dry_run:
        return dry_run(args, harness)

    start = time.time()
    sys.path.insert(0, str(Path(args.moeext).resolve()))
    import torch
    import moeext
    from moeext.presets import PRESETS
    if not torch.cuda.is_available() or "cuda" not in moeext.build_info()["backends"]:
        raise SystemExit("needs a CUDA GPU and a moeext built with CUDA")
    check_presets(harness, PRESETS)
    torch.backends.cuda.matmul.allow_tf32 = False
    status = harness.load_peers()
    from bench_cuda import mm_has_out_dtype  # beside this file, on sys.path as its folder
    has_out_dtype = mm_has_out_dtype()
    props = torch.cuda.get_device_properties(0)
    env = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "one_launch_variant": args.one_launch_variant,
           "cuda": torch.version.cuda, "peers": status, "floor_us": harness.kernel_floor_us(),
           "harness": str(Path(harness.__file__).resolve())}
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}; smallest "
          f"kernel {env['floor_us']:.2f} us", flush=True)
    for name, st in status.items():
        print(f"#   {name}: {st}", flush=True)

    rows = []
    for preset, tokens in cases(harness, args.quick, args.presets):
        try:
            row = measure_case(harness, moeext, status, has_out_dtype, preset, tokens,
                               args.one_launch_variant)
            rows.append(row)
            print(summary_line(row), flush=True)
        except Exception:  # noqa: BLE001 -- the other cases still run
            print(f"{preset} T={tokens}: ERROR\n{traceback.format_exc(limit=4)}", flush=True)
    text = markdown(rows, env)
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused_router_peers.md").write_text(text)
    (out / "fused_router_peers.json").write_text(json.dumps({"env": env, "rows": rows},
                                                            indent=1))
    print(f"wrote {out / 'fused_router_peers.md'} and .json in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
