"""``python -m benchmarks report``: the README's numbers from the results files, never by hand.

For each suite and GPU, the rows at the newest code hash recorded for that suite on that GPU (the
last recorded: ``harness.record`` appends), with the hash, GPU and torch printed beside them. Writes
each block between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``: in the README the headline
table (``numbers``), the paged kernel's table (``kernels``) and the start-up line (``startup``); in
``benchmarks/README.md`` the full current tables (``numbers``); and the figures into ``results/``
(``--no-figures`` to skip them; they need matplotlib). ``--check`` writes nothing and fails if a
committed block differs from what the results give (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from benchmarks.harness import RESULTS, ROOT, gpu_slug

SUITE_ORDER = ("decode", "serving", "hf", "startup", "kernels", "reliability", "tensor-parallel")
#: suite -> the figures its table shows (a row's variant comes first)
COLUMNS = {
    "decode": ("model", "batch", "step_ms", "vs_limit", "pipelined_vs_limit"),
    "serving": (
        "workload",
        "in_flight",
        "tpot_median_ms",
        "ttft_median_ms",
        "out_tok_s",
        "decode_step_median_ms",
        "floor_ms",
        "vs_floor",
        "token_agreement",
    ),
    "ramp": (
        "in_flight",
        "declared",
        "caches",
        "wave1_tok_s",
        "wave2_tok_s",
        "wave1_over_wave2",
        "wave1_longest_step_ms",
        "steady_step_median_ms",
        "wave1_itl_p99_ms",
        "wave2_itl_p99_ms",
        "request_path_capture_s",
        "request_path_compile_s",
        "captures_behind",
        "triton_compiles_during_waves",
    ),
    "hf": ("model", "cache", "batch", "dtype", "ms_per_token", "speedup_vs_eager", "token_agreement"),
    "startup": ("startup_s", "trace_s", "compile_s", "load_s", "capture_s", "triton_compiles", "tpot_median_ms"),
    "kernels": ("B", "context", "paged_us", "sdpa_us", "floor_us", "vs_sdpa", "vs_floor"),
    "reliability": (
        "steps",
        "wrong",
        "background_errors",
        "background_wrong",
        "concurrent_wrong",
        "passed",
        "failed",
        "transformers",
        "selection",
    ),
    "tensor-parallel": ("model", "batch", "dtype", "ms_per_token", "speedup_vs_eager", "token_agreement"),
}


def current(rows: list[dict]) -> dict[str, list[dict]]:
    """suite -> its rows at the newest code hash recorded for it (the last recorded row's)."""
    newest = {r["suite"]: r["code_hash"] for r in rows}
    return {s: [r for r in rows if r["suite"] == s and r["code_hash"] == h] for s, h in newest.items()}


def results_files() -> dict[str, dict]:
    """GPU slug -> its results file (``{"rows": [...], "recorded": {suite: when}}``, ``results/<gpu>.json``)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


def _by_recording(files: dict[str, dict], suite: str) -> list[tuple[str, list[dict]]]:
    """(GPU slug, the suite's current rows) for each GPU that measured the suite, the one that recorded
    it last at the end: per suite, so recording another suite on another GPU changes nothing here."""
    found = [(slug, now, result.get("recorded", {}).get(suite, "")) for slug, result in files.items()
             if (now := current(result.get("rows", [])).get(suite))]  # fmt: skip
    return [(slug, now) for slug, now, _ in sorted(found, key=lambda found: found[2])]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    return str(value).replace("|", "/")[:60]


def table(suite: str, rows: list[dict]) -> str:
    if suite == "serving" and any(_is_ramp(r) for r in rows):  # two workloads, two tables
        others = [r for r in rows if not _is_ramp(r)]
        ramp = table("ramp", [r for r in rows if _is_ramp(r)])
        return f"{table(suite, others)}\n\n{ramp}" if others else ramp
    columns = [c for c in COLUMNS.get(suite, ()) if any(c in r["figures"] for r in rows)]
    lines = ["| variant | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for r in rows:
        cells = [_cell(r["figures"].get(c)) for c in columns]
        if "error" in r["figures"]:
            cells = [f"error: {_cell(r['figures']['error'])}"] + [""] * (len(columns) - 1) if columns else []
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _is_ramp(row: dict) -> bool:
    return row["figures"].get("workload") == "ramp" or row["variant"].startswith("ramp")


def _stamp(rows: list[dict]) -> str:
    r = rows[0]
    return f"{gpu_slug(r['gpu']).upper()}, torch {r['torch']}, code hash `{r['code_hash'][:8]}…`"


# beside the backend's seed numbers: the hand-captured peer (the bar), and piecewise graphs alone
SEED_BESIDE = ("hand-captured", "piecewise")


def _tpot_ttft(figures: dict) -> str:
    ttft = figures.get("ttft_median_ms")
    return f"{figures['tpot_median_ms']:.2f}" + (f"/{ttft:.1f}" if ttft is not None else "")


def headline(suite: str, rows: list[dict]) -> str:
    """One line of what the suite's current rows say."""
    f = {(r["variant"], *(r["figures"].get(k) for k in ("workload", "in_flight", "B", "context"))): r["figures"]
         for r in rows}  # fmt: skip
    if suite == "kernels":
        k = f.get(("paged", None, None, 64, 1000))
        if k:
            return f"B=64, 1,000 keys: {k['paged_us']:.1f} µs; flash SDPA {k['sdpa_us']:.1f}, byte floor {k['floor_us']:.1f}"
    if suite == "serving":
        seed = f.get(("full-and-piecewise", "seed", None, None, None))
        others = [(v, f.get((v, "seed", None, None, None))) for v in SEED_BESIDE]
        at64 = f.get(("full-and-piecewise", "concurrency", 64, None, None))
        parts = []
        if seed and "tpot_median_ms" in seed:
            beside = ", ".join(f"{v} {_tpot_ttft(o)}" for v, o in others if o and "tpot_median_ms" in o)
            parts.append(f"seed TPOT/TTFT {_tpot_ttft(seed)} ms" + (f" ({beside})" if beside else ""))
        if at64 and at64.get("vs_floor"):
            parts.append(f"64 in flight: {at64['out_tok_s']:,.0f} tok/s, step {at64['vs_floor']:.2f}× its byte floor")
        ramp = f.get(("ramp-128-declared", "ramp", 128, None, None))
        if ramp and ramp.get("wave1_over_wave2"):
            parts.append(f"a fresh process's first wave of 128: {ramp['wave1_over_wave2']:.2f}× the second's tok/s")
        if parts:
            return "; ".join(parts)
    if suite == "startup":
        by = {r["variant"]: r["figures"] for r in rows if "startup_s" in r["figures"]}
        if "eager" in by:
            eager = by["eager"]["startup_s"]
            parts = [f"eager {eager:.1f} s"]
            for name, label in (("warm", "warm artifact"), ("inductor", "first deploy")):
                if name in by:
                    parts.append(f"{label} {by[name]['startup_s']:.1f} s ({by[name]['startup_s'] / eager:.2f}×)")
            return ", ".join(parts)
    if suite == "decode":
        ratios = [
            r["figures"]["vs_limit"] for r in rows if r["variant"] == "piecewise" and r["figures"].get("vs_limit")
        ]
        if ratios:
            return f"piecewise step {min(ratios):.2f}–{max(ratios):.2f}× the one-graph limit"
    if suite in ("hf", "tensor-parallel"):
        ups = [r["figures"]["speedup_vs_eager"] for r in rows if r["variant"].startswith("piecewise")
               and r["figures"].get("speedup_vs_eager")]  # fmt: skip
        if ups:
            return f"piecewise {min(ups):.1f}–{max(ups):.1f}× eager per token"
    if suite == "reliability":
        by, parts = {r["variant"]: r["figures"] for r in rows}, []
        if "fuzz" in by:
            parts.append(f"fuzz {by['fuzz'].get('steps', 0):,} steps, {by['fuzz'].get('wrong')} wrong")
        if "threads" in by:
            t = by["threads"]
            parts.append(f"threads {t.get('background_errors')} neighbour errors, {t.get('concurrent_wrong')} wrong")
        for name, t in by.items():
            if name.startswith("cuda-tests"):
                not_run = f", {t['not_run']} not run" if t.get("not_run") else ""
                label = name.replace("cuda-tests", "CUDA tests").replace("-", " ")
                parts.append(f"{label}: {t.get('passed')} passed, {t.get('failed')} failed{not_run}")
        return "; ".join(parts) or f"{len(rows)} rows"
    return f"{len(rows)} rows"


def _each_current(files: dict[str, dict]):
    """(suite, GPU slug, its current rows), suites in their order, per suite the GPU that recorded it last at the end."""
    for suite in SUITE_ORDER:
        for slug, now in _by_recording(files, suite):
            yield suite, slug, now


def numbers_table(files: dict[str, dict]) -> str:
    """One row per suite: the GPU that recorded it last (``benchmarks/README.md`` has every GPU's)."""
    lines = ["| suite | GPU | code hash | current numbers |", "| --- | --- | --- | --- |"]
    for suite in SUITE_ORDER:
        found = _by_recording(files, suite)
        if found:
            slug, now = found[-1]
            lines.append(f"| {suite} | {slug.upper()} | `{now[0]['code_hash'][:8]}` | {headline(suite, now)} |")
    return "\n".join(lines)


def full_tables(files: dict[str, dict]) -> str:
    parts = [f"#### `{suite}` ({_stamp(now)})\n\n{table(suite, now)}" for suite, _, now in _each_current(files)]
    return "\n\n".join(parts)


def _newest(files: dict[str, dict], suite: str) -> list[dict]:
    """The suite's current rows on the GPU that recorded it last."""
    found = _by_recording(files, suite)
    return found[-1][1] if found else []


def kernels_table(files: dict[str, dict]) -> str:
    """The paged kernel beside flash SDPA and the byte floor, 1,000 keys a row (the README's engine section)."""
    rows = [
        r for r in _newest(files, "kernels") if r["figures"].get("context") == 1000 and r["figures"].get("paged_us")
    ]
    if not rows:
        return "(not measured yet: `python -m benchmarks kernels`)"
    lines = [f"µs a call, 1,000 keys a row ({_stamp(rows)}):", "", "| rows | kernel | flash SDPA | bytes / bandwidth |",
             "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        f = r["figures"]
        if f["B"] in (1, 32, 128):  # the README's rows; benchmarks/README.md has them all
            lines.append(f"| {f['B']} | {_cell(f['paged_us'])} | {_cell(f['sdpa_us'])} | {_cell(f['floor_us'])} |")
    return "\n".join(lines)


def ramp_line(files: dict[str, dict]) -> str:
    """The ramp at 128 in flight, one clause per row (the README's engine section; every row:
    ``benchmarks/README.md``)."""
    by = {r["variant"]: r for r in _newest(files, "serving") if _is_ramp(r) and "error" not in r["figures"]}
    rows = [(name, by[f"ramp-128-{key}"]) for name, key in RAMP_ROWS if f"ramp-128-{key}" in by]
    if not rows:
        return "(not measured yet: `python -m benchmarks serving --variants ramp-128-declared,...`)"
    parts = []
    for name, r in rows:
        f = r["figures"]
        steady = f.get("steady_step_median_ms") or 0
        longest = f"{f['wave1_longest_step_ms'] / steady:.1f}×" if steady and f.get("wave1_longest_step_ms") else "n/a"
        parts.append(
            f"{name} {f['wave1_over_wave2']:.2f} (peak step {longest} steady, "
            f"{f['request_path_capture_s']:.1f}/{f['request_path_compile_s']:.1f} s capture/compile in calls, "
            f"{f['triton_compiles_during_waves']} Triton compiles)"
        )
    return f"wave 1 / wave 2 tok/s, 128 at once ({_stamp([rows[0][1]])}): " + "; ".join(parts) + "."


RAMP_ROWS = (("op declared", "declared"), ("not declared", "undeclared"), ("warm restart", "declared-warm"))


def startup_line(files: dict[str, dict]) -> str:
    rows = _newest(files, "startup")
    if not rows:
        return "(not measured yet: `python -m benchmarks startup`)"
    line = f"{headline('startup', rows)} ({_stamp(rows)})."
    cold = next((r["figures"] for r in rows if r["variant"] == "inductor" and "build_s" in r["figures"]), None)
    if cold:  # what a first deploy adds to eager's start: torch's trace and compile, the backend's own share
        own = cold["build_s"] - cold["compile_s"]
        line += (f" A first deploy adds Dynamo's trace ({cold['trace_s']:.1f} s) and Inductor's compile "
                 f"({cold['compile_s']:.1f} s); the backend's own share is {own:.1f} s ({own / cold['startup_s']:.0%}).")  # fmt: skip
    return line


#: file -> block name -> what writes it
BLOCKS = {
    "README.md": {"numbers": numbers_table, "startup": startup_line, "ramp": ramp_line},
    "benchmarks/README.md": {"numbers": full_tables, "kernels": kernels_table},
}


def replace_block(text: str, name: str, body: str, path: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"report: {path} has no {begin} ... {end} block to write into")
    return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{body}\n{end}", text, flags=re.S)


def figures(files: dict[str, dict]) -> list[pathlib.Path]:
    """The serving suite's TPOT figure per GPU (the seed's vLLM numbers beside it)."""
    from benchmarks.serving import figure

    written = []
    for slug, result in files.items():
        now = current(result.get("rows", [])).get("serving")
        if now and any(r["figures"].get("workload") == "seed" for r in now):
            figure(now, RESULTS / f"{slug}_seed_tpot.png")
            written.append(RESULTS / f"{slug}_seed_tpot.png")
    return written


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a committed table is not what this writes")
    parser.add_argument("--no-figures", action="store_true")
    args = parser.parse_args(argv)
    files = results_files()
    stale = []
    for name, blocks in BLOCKS.items():
        path = ROOT / name
        text = new = path.read_text()
        for block, write in blocks.items():
            new = replace_block(new, block, write(files), name)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new)
    if args.check:
        if stale:
            raise SystemExit(
                f"report: {', '.join(stale)} differ from the results files; run python -m benchmarks report"
            )
        return
    if not args.no_figures:
        stale += [p.relative_to(ROOT).as_posix() for p in figures(files)]
    print("written: " + (", ".join(stale) or "nothing changed"))
