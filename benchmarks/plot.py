"""Figure and ratio tables of a suite run: step time vs batch, one line per variant, log scale
(and the host-at-full-speed and pipelined views below it, where rows have them).

    python -m benchmarks.plot benchmarks/results/h200.json [--png benchmarks/results/h200_decode.png]

Prints Markdown tables (one per view) of each variant's step time as a multiple of the limit (the
whole step as one CUDA graph) measured in the same process where the row says so, as the README
shows them.
"""

from __future__ import annotations

import argparse
import json
import pathlib

VARIANT_ORDER = (
    "eager",
    "inductor",
    "reduce-overhead",
    "reduce-overhead+partition",
    "piecewise",
    "piecewise-eager-attention",
    "piecewise-kv-eager",
    "piecewise-graph-attention",
    "piecewise-skip-guards",
    "piecewise-no-clone",
    "piecewise-fast-call",
    "piecewise-full",
    "piecewise-full-skip-guards",
    "piecewise-full-static",
    "dynamo-floor",
    "limit",
    "limit-full",
)


PINNED = "+pinned-sdpa"  # suffix: the variant under sdpa_kernel([FLASH, EFFICIENT]) (suite.py)


def base_variant(variant: str) -> str:
    """The variant a ``+pinned-sdpa`` twin is of (a variant itself otherwise)."""
    return variant[: -len(PINNED)] if variant.endswith(PINNED) else variant


def in_order(variants) -> list[str]:
    """``variants`` in ``VARIANT_ORDER``, each ``+pinned-sdpa`` twin right after its variant."""
    present = set(variants)
    return [v for base in VARIANT_ORDER for v in (base, base + PINNED) if v in present]


def _color_index(variant: str, n: int) -> int:
    """The dark shades of tab20 first, then the light ones: neighbours in VARIANT_ORDER differ (a
    pinned twin takes its variant's colour, dotted)."""
    i = 2 * VARIANT_ORDER.index(base_variant(variant))
    return i % n + i // n


# the two views of a step, as the figure's rows of panels name them
VIEW_TITLES = {
    "step_ms": "waiting for each step",
    "step_ms_fast_host": "waiting, host at full speed",
    "pipelined_ms": "host running ahead",
}


def plot(rows: list[dict], png: pathlib.Path) -> None:
    """One panel per model and view: ``step_ms`` always, ``step_ms_fast_host`` and ``pipelined_ms``
    as further rows of panels where rows have them. Why all: waiting for every step shows host
    latency on top of the graph (with the host at full speed: without the machine's slow spells),
    running ahead shows what the GPU spends, and they rank the variants differently
    (reduce-overhead, recording new lengths, is 10x the limit in one and at it in the other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    views = [f for f in VIEW_TITLES if any(r.get(f) for r in rows)]
    fig, axes = plt.subplots(
        len(views), len(models), figsize=(6 * len(models) + 2, 4.5 * len(views)), squeeze=False, sharey="col"
    )  # one scale per model: views compare by eye
    colors = plt.get_cmap("tab20").colors  # one colour per variant in every panel
    legend: dict = {}
    for axes_row, field in zip(axes, views):
        for ax, model in zip(axes_row, models):
            for variant in in_order(r["variant"] for r in rows):
                points = sorted(
                    (r["batch"], r[field])
                    for r in rows
                    if r["model"] == model and r["variant"] == variant and r.get(field)
                )
                if points:
                    (line,) = ax.plot(
                        *zip(*points),
                        marker="o",
                        label=variant,
                        color=colors[_color_index(variant, len(colors))],
                        linewidth=2.5 if variant.startswith("piecewise") else 1.2,
                        linestyle="--" if variant.startswith("limit") else ":" if variant.endswith(PINNED) else "-",
                    )
                    legend.setdefault(variant, line)
            ax.set_xscale("log", base=2)
            batches = sorted({r["batch"] for r in rows if r["model"] == model})
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_yscale("log")
            ax.set_xlabel("batch")
            ax.set_ylabel("decode step, ms (median)")
            ax.set_title(f"{model}: {VIEW_TITLES[field]}")
            ax.grid(True, which="both", alpha=0.3)
    ordered = in_order(legend)  # every variant of every panel, in one legend
    axes[0][-1].legend([legend[v] for v in ordered], ordered, fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# a row's time field -> the field naming the limit's time in the row's own process (written by
# suite._mark_process, read by vs_limit)
SAME_PROCESS_LIMIT = {
    "step_ms": "limit_same_process_ms",
    "pipelined_ms": "limit_same_process_pipelined_ms",
    "step_ms_fast_host": "limit_same_process_fast_host_ms",
}


def limit_times(rows: list[dict], field: str = "step_ms") -> dict[tuple, float]:
    """The limit's ``field`` per (model, batch), from the rows that measured it."""
    return {(r["model"], r["batch"]): r[field] for r in rows if r["variant"] == "limit" and r.get(field)}


def vs_limit(row: dict, limits: dict[tuple, float], field: str = "step_ms") -> float | None:
    """``row``'s ``field`` (a step time) as a multiple of the limit's, or None without both times.

    The limit of the row's own process (``limit_same_process_ms``) where the row has it, else the
    limit row of its model and batch. Why: a suite split over several device calls has a limit in
    each process, and they differ by up to 10% at batch 1 (0.98 and 1.08 ms in the 2026-11-29 run);
    a ratio across processes would carry that difference."""
    limit = row.get(SAME_PROCESS_LIMIT[field]) or limits.get((row["model"], row["batch"]))
    return row[field] / limit if row.get(field) and limit else None


def ratios_to_limit(rows: list[dict]) -> list[dict]:
    """Each row's step time as a multiple of the limit's (same model and batch; same process where
    known), its pipelined time's (``pipelined_vs_limit``) and its time with the host at full speed
    (``vs_limit_fast_host``, ``suite.fast_host_times``) where both were measured."""
    limits = {field: limit_times(rows, field) for field in SAME_PROCESS_LIMIT}
    ratios = []
    for r in rows:
        ratio = vs_limit(r, limits["step_ms"])
        if ratio is None:
            continue
        entry = {"model": r["model"], "variant": r["variant"], "batch": r["batch"], "vs_limit": round(ratio, 3)}
        for field, name in (("pipelined_ms", "pipelined_vs_limit"), ("step_ms_fast_host", "vs_limit_fast_host")):
            if (other := vs_limit(r, limits[field], field)) is not None:
                entry[name] = round(other, 3)
        ratios.append(entry)
    return ratios


def ratio_table(rows: list[dict], field: str = "step_ms") -> str:
    """Markdown: per variant and (model, batch), ``field`` as a multiple of the limit's."""
    limits = limit_times(rows, field)
    keys = sorted({(r["model"], r["batch"]) for r in rows})
    lines = ["| variant | " + " | ".join(f"{m} b{b}" for m, b in keys) + " |", "| --- |" + " ---: |" * len(keys)]
    measured = {r["variant"] for r in rows if r.get(field) or r.get("error")}
    for variant in in_order(measured):  # no line of empty cells
        cells = []
        for model, batch in keys:
            row = next((r for r in rows if (r["model"], r["batch"], r["variant"]) == (model, batch, variant)), None)
            if row is None:
                cells.append("")
            elif not row.get(field):
                cells.append("error" if row.get("error") or row.get("pipelined_error") else "")
            elif (ratio := vs_limit(row, limits, field)) is not None:
                cells.append(f"{ratio:.2f}×")
            else:
                cells.append(f"{row[field]:.2f} ms")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--png")
    args = parser.parse_args()
    rows = json.loads(pathlib.Path(args.results).read_text())["decode"]
    if args.png:
        plot(rows, pathlib.Path(args.png))
    for field, title in VIEW_TITLES.items():
        if any(r.get(field) for r in rows):
            print(f"{title}:\n{ratio_table(rows, field)}")


if __name__ == "__main__":
    main()
