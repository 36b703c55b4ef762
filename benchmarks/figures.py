"""The headline figures of README.md and docs/benchmarks.md, from one source: docs/figures.json.

    python benchmarks/figures.py add results/train_loop-*.json --condition "2 cores shared with other work"
    python benchmarks/figures.py add results/stall-*.json --condition "a quiet 2-core machine"
    python benchmarks/figures.py write     # rewrite the marked blocks of README.md and docs/benchmarks.md
    python benchmarks/figures.py check     # exit 1 if a block differs from what the source gives

docs/figures.json holds one record per benchmark run (``train_loop.py``, ``stall.py``): its figures,
when it ran, the machine's load average, where the record came from, and the run's condition (a
quiet machine or one shared with other work: the figures move with it by an order of magnitude).
The pages carry the figures between ``<!-- figures:NAME -->`` and ``<!-- /figures -->`` marks, as
:func:`render` writes them from the records: the spread over the runs of each condition, never
one run's figure alone. tests/test_docs.py checks that the pages hold what the source gives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "docs", "figures.json")
PAGES = ("README.md", os.path.join("docs", "benchmarks.md"))
STALL_GOAL_X = 1.2  # stall.py's goal: a warm stall within 1.2x a memcpy of the same bytes
_BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


# ---------------------------------------------------------------------- records from results JSON
def train_loop_record(result: dict, *, condition: str, source: str) -> dict:
    """The figures of one ``train_loop.py`` run (its JSON): each mode's median stall, the ratio."""
    rows = {row["mode"]: row for row in result["rows"]}
    env = result["environment"]
    return {"when": env["time"], "condition": condition, "source": source, "cpus": env["cpu_count"],
            "load_avg_1min": round(env["load_avg_1_5_15min"][0], 1), "job_s": round(result["total_wall_s"]),
            "state_mib": round(rows["s3-async"]["checkpoint_mib"]),
            "staging": result.get("staging", {}).get("s3-async", "blocking"),  # runs before the key: blocking
            "stall_s": {mode: round(row["stall_s"], 3) for mode, row in rows.items()},
            "stalled_pct": {mode: round(row["stalled_pct"], 1) for mode, row in rows.items()},
            "x_less_stall": round(rows["s3-async"]["vs_monolithic"], 1)}


def stall_record(result: dict, *, condition: str, source: str) -> dict:
    """The figures of one ``stall.py`` run (its JSON), per state shape."""
    env = result["environment"]
    shapes = {name: {"tensors": s["tensors"], "warm_stall_s": round(s["stall_warm_median_s"], 3),
                     "x_memcpy_now": round(s["stall_vs_memcpy_now"], 2), "cold_stall_s": round(s["stall_first_s"], 3)}
              for name, s in result["summary"].items()}
    return {"when": env["time"], "condition": condition, "source": source, "cpus": env["cpu_count"],
            "load_avg_1min": round(env["load_avg_1_5_15min"][0], 1),
            "state_mib": round(next(iter(result["summary"].values()))["state_mib"]), "shapes": shapes}


# ---------------------------------------------------------------------- what the pages say
def _span(values, fmt: str, unit: str = "") -> str:
    """``"lo–hi"`` of ``values`` as printed (one figure when they print alike); a value may be a
    ``[lo, hi]`` pair, as an earlier run recorded only its range."""
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    lo, hi = min(flat), max(flat)
    return f"{lo:{fmt}}{unit}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}–{hi:{fmt}}{unit}"


def _ms(seconds):
    return [v * 1e3 for v in seconds] if isinstance(seconds, list) else seconds * 1e3


def _x(value: float) -> str:
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def _by_condition(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["condition"], []).append(record)
    return groups


def _runs(group: list[dict]) -> str:
    loads = [r["load_avg_1min"] for r in group if r.get("load_avg_1min") is not None]
    load = f", load average {_span(loads, '.0f')}" if loads else ""
    return f"{len(group)} run{'s' if len(group) > 1 else ''}{load}"


def _train_loop_spread(records: list[dict]) -> str:
    parts = []
    for condition, group in _by_condition(records).items():
        ratios = [r["x_less_stall"] for r in group]
        asyncs = [r["stall_s"]["s3-async"] for r in group]
        monos = [r["stall_s"]["monolithic"] for r in group]
        median = f", median {_x(statistics.median(ratios))}x" if len(group) > 1 else ""
        parts.append(f"{_span([float(_x(x)) for x in ratios], 'g')}x on {condition} ({_runs(group)}{median}; "
                     f"{_span(asyncs, '.3f')} s against {_span(monos, '.2f')} s per checkpoint)")
    return "; by ".join(parts)


def render_train_loop(records: list[dict]) -> str:
    """The runs with the mode's staging of today (``staging``: background) first; the earlier
    ones, whose ``async_save`` returned after the copy, after them."""
    now = [r for r in records if r.get("staging", "blocking") == "background"]
    before = [r for r in records if r not in now]
    text = ("- `train_loop.py` (the main job, below): `dcp.async_save`, staging in the background, stalls "
            "training less than `torch.save` + boto3 by " + _train_loop_spread(now or before) + ".")
    stalled = [r for r in now if "stalled_pct" in r]
    if stalled:
        text += (f" Counting the waits for the previous upload (a checkpoint every few steps here), the loop stood "
                 f"still {_span([r['stalled_pct']['s3-async'] for r in stalled], '.0f')}% of its time against "
                 f"{_span([r['stalled_pct']['monolithic'] for r in stalled], '.0f')}% for `torch.save` + boto3.")
    if now and before:
        text += " Staging inside `async_save` (before background staging): by " + _train_loop_spread(before) + "."
    return text + " The ratios move with the machine's load, as the async stall does.\n"


def render_stall(records: list[dict]) -> str:
    parts = []
    for condition, group in _by_condition(records).items():
        shapes = [s for r in group for s in r["shapes"].values()]
        by_shape = {}
        for r in group:
            for name, s in r["shapes"].items():
                by_shape.setdefault(name, []).append(s)
        ratios = ", ".join(f"{_span([s['x_memcpy_now'] for s in ss], '.2f')}x ({ss[0]['tensors']} tensors)"
                           for ss in by_shape.values())
        met = all(s["x_memcpy_now"] <= STALL_GOAL_X for s in shapes)
        parts.append(f"on {condition} ({_runs(group)}): warm {_span([_ms(s['warm_stall_s']) for s in shapes], '.0f')}"
                     f" ms, {ratios} a memcpy of the same bytes timed right before it, the cold first checkpoint "
                     f"{_span([s['cold_stall_s'] for s in shapes], '.2f')} s — goal {'met' if met else 'missed'}")
    mib = records[0]["state_mib"] if records else 512
    return (f"- `stall.py` (goal: a warm stall within {STALL_GOAL_X}x a memcpy): a `dcp.async_save` of {mib} MiB "
            "blocks " + "; ".join(parts) + ".\n")


def render_timeline(records: list[dict]) -> str:
    """The paragraph under the README's timeline plot: the run the plot draws."""
    drawn = [r for r in records if r.get("drawn")]
    if len(drawn) != 1:
        raise ValueError("exactly one train_loop record must say \"drawn\": true (docs/train_loop_timeline.png)")
    r = drawn[0]
    s = r["stall_s"]
    return (f"{r['state_mib']} MiB per checkpoint, one rank, {r['condition']}, local SeaweedFS (the whole job took "
            f"{r['job_s']} s): `torch.save` + boto3 stalled {s['monolithic']:.2f} s per checkpoint, `dcp.save` to "
            f"S3 {s['s3-sync']:.2f} s, to local disk {s['fs-sync']:.2f} s, `dcp.async_save` to S3 "
            f"{s['s3-async']:.3f} s — {_x(r['x_less_stall'])}x less than monolithic (medians of 3).\n")


def render(figures: dict) -> dict[str, str]:
    """Every block's text, by name, from the source's records, wrapped as the pages are."""
    texts = {"train_loop": render_train_loop(figures["train_loop"]), "stall": render_stall(figures["stall"]),
             "timeline": render_timeline(figures["train_loop"])}
    return {name: _wrap(text) for name, text in texts.items()}


def _wrap(text: str, width: int = 96) -> str:
    """``text`` filled to ``width``, a list item's lines indented; no line starts with ``+`` or
    ``-`` (Markdown would read a list item there), so the width gives way a little if need be."""
    indent = "  " if text.startswith("- ") else ""
    for w in range(width, width - 20, -1):
        lines = textwrap.wrap(text.strip(), width=w, subsequent_indent=indent, break_on_hyphens=False,
                              break_long_words=False)
        if not any(line.lstrip().startswith(("+ ", "- ")) for line in lines[1:]):
            break
    return "\n".join(lines) + "\n"


def rewrite(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the body of every marked block replaced by ``blocks[name]``."""
    def body(m: re.Match) -> str:
        if m.group("name") not in blocks:
            raise KeyError(f"no figures named {m.group('name')!r} (there are {sorted(blocks)})")
        return m.group(1) + blocks[m.group("name")] + m.group(4)
    return _BLOCK.sub(body, text)


def blocks_in(text: str) -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}


# ---------------------------------------------------------------------- command line
def _load() -> dict:
    with open(SOURCE, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add the runs of results JSON files to docs/figures.json, then write")
    add.add_argument("results", nargs="+")
    add.add_argument("--condition", required=True, help='e.g. "a quiet 2-core machine"')
    sub.add_parser("write", help="rewrite the marked blocks of the pages from docs/figures.json")
    sub.add_parser("check", help="exit 1 if a marked block differs from docs/figures.json")
    args = parser.parse_args(argv)
    figures = _load()
    if args.command == "add":
        for path in args.results:
            with open(path, encoding="utf-8") as f:
                result = json.load(f)
            kind = result.get("benchmark")
            make = {"train_loop": train_loop_record, "stall": stall_record}.get(kind)
            if make is None:
                parser.error(f"{path}: a {kind!r} result; only train_loop and stall results are figures")
            record = make(result, condition=args.condition, source=os.path.basename(path))
            if any(r["when"] == record["when"] for r in figures[kind]):
                print(f"{path}: already in {SOURCE}", file=sys.stderr)
                continue
            figures[kind].append(record)
        with open(SOURCE, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
            f.write("\n")
    blocks = render(figures)
    stale = []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = rewrite(text, blocks)
        if new != text:
            stale.append(page)
            if args.command != "check":
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    if args.command == "check" and stale:
        print(f"figures differ from {SOURCE} in: {', '.join(stale)} (python benchmarks/figures.py write)",
              file=sys.stderr)
        return 1
    if args.command != "check":
        print(f"{'rewrote ' + ', '.join(stale) if stale else 'pages already agree'} ({SOURCE})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
