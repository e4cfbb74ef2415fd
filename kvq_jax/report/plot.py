"""`kvq report --plot FILE.png`: error (percent) vs bits/element, one labelled point per policy.

Four panels: K reconstruction, V reconstruction, attention output (mean over layers and
query heads) and decode-like attention (the attention panels are left empty without
queries). matplotlib is imported lazily with the Agg backend (the `plot` extra).
"""

from __future__ import annotations

from kvq_jax.report.evaluate import PolicyResult

_COLORS = {
    "int4": "tab:blue",
    "nvfp4": "tab:orange",
    "fp8_e4m3": "tab:green",
    "int2": "tab:red",
    "intb": "tab:brown",  # per-layer INTB keys (values in another format)
    "bf16": "black",
}


def _color(r: PolicyResult) -> str:
    if r.base_format == "intb":
        return _COLORS["intb"]
    if len(set(r.k_loop_formats) | set(r.v_loop_formats)) > 1:
        return "tab:purple"
    return _COLORS.get(r.base_format, "tab:gray")


def write_plot(results: list[PolicyResult], path, title: str = "") -> None:
    """Write the PNG to `path` (raises ImportError naming the `plot` extra without it)."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("--plot needs matplotlib: pip install -e '.[plot]'") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = (
        ("K relative L2 (%)", lambda r: r.k_rel_l2),
        ("V relative L2 (%)", lambda r: r.v_rel_l2),
        ("attention output error, mean over layers x heads (%)", lambda r: r.attention_mean),
        ("decode-like attention error (last 64 queries, own window raw) (%)",
         lambda r: r.attention_decode_mean),
    )  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5), constrained_layout=True)
    # error 0 (the bf16 reference) has no place on a log axis: it is named in the title
    results = [r for r in results if r.k_rel_l2 > 0 or r.v_rel_l2 > 0]
    if not results:
        plt.close(fig)
        raise ValueError("results: no quantized policy to plot")
    xmax = max(r.bits_per_element for r in results)
    for ax, (label, value) in zip(axes.flat, panels, strict=True):
        points = [(r, 100 * value(r)) for r in results if value(r) is not None and value(r) > 0]
        for r, y in points:
            windowed = r.window is not None
            ax.scatter(
                r.bits_per_element,
                y,
                s=46,
                edgecolors=_color(r),
                marker="s" if windowed else "o",
                facecolors="none" if windowed else _color(r),
                zorder=3,
            )
        ax.set_xlabel("bits / element (K and V, all loops)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.set_xlim(min(3.5, *(r.bits_per_element - 0.5 for r in results)), xmax * 1.1 + 1)
        ax.set_yscale("log")  # errors span 1% to 50%: a log axis keeps the 4-bit cluster apart
        plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ys = [y for _, y in points] or [1.0]
        ax.set_ylim(min(ys) / 1.25, max(ys) * 1.4)
        if not points:
            ax.text(0.5, 0.5, "no queries in the capture", ha="center", transform=ax.transAxes)
        _label_points(ax, fig, points)
    legend = (
        "filled: no window; open squares: +win (first 4 and last 16 tokens kept in bf16); "
        "log error axes (bf16, 16 bits and 0% error, not drawn)"
    )
    fig.suptitle(f"{title or 'kvq report'}\n{legend}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label_points(ax, fig, points, fontsize: float = 7.5) -> None:
    """Label every point to its right, moving labels up or down (with a leader line) until
    they do not overlap an earlier label (greedy, in display pixels)."""
    px_per_pt = fig.dpi / 72
    height = (fontsize + 2) * px_per_pt
    placed: list[tuple[float, float, float]] = []  # (x0, x1, y) of each label box
    order = sorted(points, key=lambda p: (p[1], p[0].bits_per_element))
    for r, y in order:
        x0, y0 = ax.transData.transform((r.bits_per_element, y))
        lx0 = x0 + 6 * px_per_pt
        lx1 = lx0 + 0.6 * fontsize * px_per_pt * len(r.name)
        ly = y0 - height / 3
        for step in range(40):
            shift = (step + 1) // 2 * height * (1 if step % 2 else -1)
            cand = ly + shift
            if all(
                not (lx0 < b1 and b0 < lx1 and abs(cand - by) < height) for b0, b1, by in placed
            ):
                ly = cand
                break
        placed.append((lx0, lx1, ly))
        dy = (ly - (y0 - height / 3)) / px_per_pt
        ax.annotate(
            r.name,
            (r.bits_per_element, y),
            textcoords="offset points",
            xytext=(6, dy - fontsize / 3),
            fontsize=fontsize,
            va="bottom",
            arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5") if abs(dy) > fontsize else None,
        )
