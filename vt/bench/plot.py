"""Plots for `vt bench --plot`: latency CDFs and output throughput over time, one line per arm.

matplotlib is imported only here, and only when a plot is asked for (it is the `bench` extra,
installed from the clone or as plain `matplotlib`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vt.bench.stats import RequestRecord, e2els, throughput_over_time, tpots, ttfts

# vt-serve is not on the package index, so `pip install 'vt-serve[bench]'` finds nothing: name what works
MISSING_MATPLOTLIB = ("--plot needs matplotlib: pip install matplotlib, or in vt's clone pip install -e "
                      "'.[bench]' (the vt-serve[bench] extra; vt-serve is not on the package index)")


def plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _cdf(ax, values_s: Sequence[float], label: str) -> None:
    if not values_s:
        return
    xs = sorted(v * 1000.0 for v in values_s)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def _bucket_s(arms: Mapping[str, Sequence[Sequence[RequestRecord]]]) -> float:
    """1 s buckets, or a tenth of the longest run when it is shorter than 10 s."""
    span = max((r.end for runs in arms.values() for run in runs for r in run), default=0.0)
    return 1.0 if span >= 10.0 else max(span / 10.0, 1e-3)


def save_plot(path: str, arms: Mapping[str, Sequence[Sequence[RequestRecord]]]) -> None:
    """Write a 2x2 PNG: TTFT, TPOT and E2EL CDFs (ms) and output tok/s per second of the run.

    `arms` maps an arm name to its runs (each a list of records); repeats of an arm are pooled in the
    CDFs and drawn as separate throughput lines.
    """
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = ((axes[0][0], ttfts, "TTFT"), (axes[0][1], tpots, "TPOT"), (axes[1][0], e2els, "E2EL"))
    for ax, fn, name in panels:
        for arm, runs in arms.items():
            _cdf(ax, [v for run in runs for v in fn(run)], arm)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax = axes[1][1]
    bucket = _bucket_s(arms)
    for color, (arm, runs) in enumerate(arms.items()):
        for i, run in enumerate(runs):
            series = throughput_over_time(run, bucket)
            if series:
                label = arm if len(runs) == 1 else f"{arm} #{i + 1}"
                ax.plot([t for t, _ in series], [v for _, v in series], marker=".", label=label,
                        color=f"C{color}", linestyle=("-", "--", ":", "-.")[i % 4])
    ax.set_title("Output throughput over time")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"output tokens/s ({bucket:.3g} s buckets)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
