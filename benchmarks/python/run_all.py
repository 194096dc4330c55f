"""Every moeext benchmark in one process: moeext against what users run today.

Prints one ratio table (each baseline measured in the same run as the moeext op it is
compared with). Options:
    --quick           small shapes, for CI smoke
    --plot FILE.png   latency versus tokens per op, log axes (needs matplotlib)
    --markdown        print the table as markdown, with the date and the machine line
    --update-readme   rewrite the README's performance block with that markdown

    python benchmarks/python/run_all.py [--quick] [--plot perf.png] [--update-readme]
"""

import argparse
import datetime
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_grouped_topk  # noqa: E402
import bench_mxfp4_shuffle  # noqa: E402
import bench_router_gemm  # noqa: E402
import bench_zero_tail  # noqa: E402
from common import machine_line  # noqa: E402

SUITES = [bench_grouped_topk, bench_router_gemm, bench_zero_tail, bench_mxfp4_shuffle]
README = HERE.parents[1] / "README.md"
BEGIN, END = "<!-- perf:begin (benchmarks/python/run_all.py --update-readme) -->", "<!-- perf:end -->"


def markdown(rows, machine):
    lines = [f"Measured {datetime.date.today().isoformat()} on {machine}.", "",
             "| op | case | moeext (us) | baseline | baseline (us) | moeext speed-up |",
             "|---|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.op} | {r.case} | {r.moeext_s * 1e6:.1f} | {r.baseline} | "
                     f"{r.baseline_s * 1e6:.1f} | {r.speedup:.1f}x |")
    return "\n".join(lines)


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
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args(argv)
    if args.quick and args.update_readme:  # the README's table is the full run
        parser.error("--update-readme pastes the full run: leave out --quick")
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
    if args.update_readme:
        text = README.read_text()
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
        print(f"updated {README}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
