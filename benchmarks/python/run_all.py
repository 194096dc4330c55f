"""Every moeext benchmark in one process: moeext against what users run today.

Prints one ratio table (each baseline measured in the same run as the moeext op it is
compared with). Options:
    --quick                     small shapes, for CI smoke
    --plot FILE.png             latency versus tokens per op, log axes (needs matplotlib)
    --markdown                  print the table as markdown, with the date and the machine line
    --write-performance [FILE]  put that markdown in FILE (default docs/PERFORMANCE.md) between
                                its CPU-table markers; the rest of the file (the GPU tables,
                                measured elsewhere) is left as it is. A FILE that does not
                                exist is created holding the table alone. --quick only writes
                                to a FILE other than docs/PERFORMANCE.md.

    python benchmarks/python/run_all.py [--quick] [--plot perf.png] [--write-performance [FILE]]

The README's compact table is picked by hand from docs/PERFORMANCE.md; this script leaves the
README alone.
"""

import argparse
import datetime
import pathlib
import sys

import moeext

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_fused_router  # noqa: E402
import bench_grouped_topk  # noqa: E402
import bench_mxfp4_shuffle  # noqa: E402
import bench_router_gemm  # noqa: E402
import bench_routing_options  # noqa: E402
import bench_zero_tail  # noqa: E402
from common import machine_line  # noqa: E402

SUITES = [bench_grouped_topk, bench_routing_options, bench_router_gemm, bench_fused_router,
          bench_zero_tail, bench_mxfp4_shuffle]
PERFORMANCE = HERE.parents[1] / "docs" / "PERFORMANCE.md"
BEGIN = "<!-- cpu-table:begin (benchmarks/python/run_all.py --write-performance) -->"
END = "<!-- cpu-table:end -->"


def cpu_detail():
    """Which CPU this run had, from /proc/cpuinfo: "family 25 model 1, AVX2, no AVX-512". The
    shared VMs' model name reads "AMD EPYC" whatever the generation behind it."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return "CPU unknown"
    flags = set(info.get("flags", "").split())
    isa = ("AVX-512 with AVX512-BF16" if "avx512_bf16" in flags else "AVX-512"
           if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    return f"family {info.get('cpu family', '?')} model {info.get('model', '?')}, {isa}"


def markdown(rows, machine):
    cpu, _, rest = machine.partition(", ")
    lines = [f"Measured {datetime.date.today().isoformat()} on {cpu} ({cpu_detail()}), {rest}, "
             f"built by {moeext.build_info()['compiler']}.", "",
             "| op | case | moeext (us) | baseline | baseline (us) | moeext speed-up |",
             "|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.case} | {r.moeext_s * 1e6:.1f} | {r.baseline} | "
                     f"{r.baseline_s * 1e6:.1f} | {r.speedup:.1f}x |")
    return "\n".join(lines)


def _has_one_block(text):
    """Whether text holds exactly one BEGIN ... END block."""
    return (text.count(BEGIN) == 1 and text.count(END) == 1
            and text.index(BEGIN) < text.index(END))


def write_performance(path, table):
    """Replaces the block between BEGIN and END in path with table; creates path if absent."""
    block = f"{BEGIN}\n{table}\n{END}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# moeext CPU benchmarks\n\n{block}\n")
        return
    head, rest = path.read_text().split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{block}{tail}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for r in rows:
        if r.x is None:
            continue
        preset = r.case.split(" T=")[0]
        # A case compared with several baselines repeats its moeext time: one point per x.
        series.setdefault((r.op, preset, "moeext"), {})[r.x] = r.moeext_s * 1e6
        series.setdefault((r.op, preset, r.baseline), {})[r.x] = r.baseline_s * 1e6
    ops = sorted({key[0] for key in series})
    fig, axes = plt.subplots(1, len(ops), figsize=(7 * len(ops), 5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for (o, preset, who), points in sorted(series.items()):
            if o != op:
                continue
            xs, ys = zip(*sorted(points.items()))
            ax.plot(xs, ys, marker="o", linestyle="-" if who == "moeext" else "--",
                    label=f"{preset} — {who}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("median latency (us)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--write-performance", metavar="FILE", nargs="?", const=PERFORMANCE,
                        type=pathlib.Path)
    args = parser.parse_args(argv)
    target = args.write_performance
    if args.quick and target is not None and target.resolve() == PERFORMANCE:
        parser.error("docs/PERFORMANCE.md holds the full run: leave out --quick, or name "
                     "another FILE")
    if target is not None and target.exists() and not _has_one_block(target.read_text()):
        parser.error(f"{target} has no single {BEGIN} ... {END} block to replace")
    if args.plot:
        try:  # before minutes of benchmarks, not after them
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    machine = machine_line()
    print(f"# moeext benchmarks — {machine}")
    rows = []
    for suite in SUITES:
        for row in suite.rows(quick=args.quick):
            print(row.line(), flush=True)
            rows.append(row)
    table = markdown(rows, machine)
    if args.markdown:
        print()
        print(table)
    if target is not None:
        write_performance(target, table)
        print(f"wrote the CPU table into {target}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
