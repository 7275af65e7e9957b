"""The timeline: what the engine does with every tensor, on every rank, over time.

Record it with `KERAS_RING_TIMELINE=path` (or `HOROVOD_TIMELINE`) when the
job starts, or with `start_timeline(path)` / `stop_timeline()` while it runs.
Every rank writes its own file, `path` with `.rank<r>` before `.json`
(`trace.json` gives `trace.rank0.json`, `trace.rank1.json`, ...), in the
Chrome trace event format that https://ui.perfetto.dev and chrome://tracing
open. Then, from the shell:

```
python -m keras_ring.timeline merge trace.json          # the ranks' files -> trace.json
python -m keras_ring.timeline plot trace.json trace.png  # a picture, with matplotlib
```

A file whose rank was killed while recording lacks only its closing bracket,
which the format allows; `load` reads it, and so does `merge`.
"""

import argparse
import json
import os
import re

from keras_ring.core._timeline import file_stem, rank_file, start_timeline, stop_timeline

__all__ = ["PHASES", "load", "main", "merge", "plot", "rank_file", "rank_files", "spans",
           "start_timeline", "stop_timeline"]

# The phases the engine records inside a collective's span (docs/timeline.md).
PHASES = ("QUEUE", "PACK", "COMMUNICATE", "UNPACK", "DONE")


def rank_files(path):
    """The ranks' files recorded for `path`, in rank order."""
    stem = file_stem(path)
    folder = os.path.dirname(stem) or "."
    pattern = re.compile(re.escape(os.path.basename(stem)) + r"\.rank(\d+)\.json$")
    found = []
    for name in os.listdir(folder):
        match = pattern.match(name)
        if match:
            found.append((int(match[1]), os.path.join(folder, name)))
    return [file for _, file in sorted(found)]


def load(path):
    """Reads a trace file, also one cut short by a crash; returns its list of events.

    Accepts the JSON array format with or without its closing bracket, a last
    event cut in the middle (dropped), and the JSON object format
    (`{"traceEvents": [...]}`).
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        return json.loads(text)["traceEvents"]
    start = text.find("[")
    if start < 0:
        raise ValueError(f"keras-ring: {path} is not a trace file (no JSON array)")
    decoder = json.JSONDecoder()
    events, i = [], start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return events
        try:
            event, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return events  # the process died while this event was being written
        events.append(event)


def merge(path, output=None):
    """Joins the ranks' files recorded for `path` into one trace, one process row per rank.

    Args:
        path: The path given to `start_timeline` or `KERAS_RING_TIMELINE`.
        output: Where to write the merged trace (default: `path`, with
            `.json` added if it lacks it).

    Returns:
        The path of the merged trace.

    Raises:
        FileNotFoundError: if no rank's file exists.
    """
    files = rank_files(path)
    if not files:
        raise FileNotFoundError(
            f"keras-ring: no timeline files {rank_file(path, '<r>')} (record with "
            "KERAS_RING_TIMELINE or kr.start_timeline())"
        )
    output = output or f"{file_stem(path)}.json"
    events = [event for file in files for event in load(file)]
    with open(output, "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in events) + "\n]\n")
    return output


def spans(events):
    """The spans of a trace: dicts with pid, tid, name, start, end (microseconds), depth, args.

    `B`/`E` pairs and `X` events become spans (a `B` never ended lasts to the
    end of the trace: its rank was stopped while it was open); `depth` is 0
    for a row's top-level spans.
    """
    out, open_spans = [], {}
    last = max((e.get("ts", 0) + e.get("dur", 0) for e in events if "ts" in e), default=0)
    for e in sorted((e for e in events if "ts" in e), key=lambda e: e["ts"]):
        row = (e["pid"], e.get("tid", 0))
        stack = open_spans.setdefault(row, [])
        if e["ph"] == "B":
            stack.append(e)
        elif e["ph"] == "E" and stack:
            begin = stack.pop()
            out.append(_span(begin, begin["ts"], e["ts"], len(stack)))
        elif e["ph"] == "X":
            out.append(_span(e, e["ts"], e["ts"] + e.get("dur", 0), len(stack)))
    for stack in open_spans.values():
        out += [_span(b, b["ts"], last, depth) for depth, b in enumerate(stack)]
    return out


def _span(event, start, end, depth):
    return {
        "pid": event["pid"],
        "tid": event.get("tid", 0),
        "name": event["name"],
        "start": start,
        "end": end,
        "depth": depth,
        "args": event.get("args", {}),
    }


_COLOURS = {
    "NEGOTIATE": "#d0d0d0",
    "QUEUE": "#fdae6b",
    "PACK": "#74c476",
    "COMMUNICATE": "#3182bd",
    "UNPACK": "#a1d99b",
    "DONE": "#9e9ac8",
}
_COLLECTIVE_COLOUR = "#deebf7"


def plot(trace_path, image_path, start_ms=None, duration_ms=None, title=None):
    """Draws a trace as a chart of bars, one row per rank and tensor, into an image (matplotlib).

    Args:
        trace_path: A trace file (merged, or one rank's).
        image_path: The image to write (`.png`, `.svg`, ...).
        start_ms: Where the window starts, in milliseconds after the trace's
            first event (default 0).
        duration_ms: The window's length in milliseconds (default: to the end).
        title: Above the chart (default: the trace's file name).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load(trace_path)
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] in ("thread_name", "process_name")
    }
    all_spans = spans(events)
    if not all_spans:
        raise ValueError(f"keras-ring: {trace_path} holds no spans to plot")
    origin = min(s["start"] for s in all_spans)
    low = (start_ms or 0) * 1000
    high = low + duration_ms * 1000 if duration_ms is not None else float("inf")
    shown = [s for s in all_spans if s["end"] - origin >= low and s["start"] - origin <= high]
    rows = sorted({(s["pid"], s["tid"]) for s in shown})
    y = {row: i for i, row in enumerate(rows)}
    figure, axes = plt.subplots(figsize=(12, 1.6 + 0.32 * len(rows)))
    for s in sorted(shown, key=lambda s: s["depth"]):  # phases over their span
        start, end = (s["start"] - origin) / 1000, (s["end"] - origin) / 1000
        top = s["depth"] == 0
        colour = _COLOURS.get(s["name"], _COLLECTIVE_COLOUR if top else "#969696")
        height = 0.8 if top else 0.5
        axes.barh(
            y[(s["pid"], s["tid"])],
            max(end - start, 1e-3),
            left=start,
            height=height,
            color=colour,
            edgecolor="#4a4a4a" if top else "none",
            linewidth=0.4,
        )
    # Fused tensors: one collective, several rows; a line joins them at its start.
    groups = {}
    for s in shown:
        if s["depth"] == 0 and s["args"].get("tensors", 1) > 1:
            groups.setdefault((s["pid"], s["name"], s["args"]["group"]), []).append(s)
    for members in groups.values():
        at = (min(m["start"] for m in members) - origin) / 1000
        ys = [y[(m["pid"], m["tid"])] for m in members]
        axes.vlines(at, min(ys) - 0.45, max(ys) + 0.45, color="black", linewidth=1.2)
    for e in events:
        if e.get("ph") == "i" and e["name"] == "CYCLE":
            ranks_rows = [i for (pid, _), i in y.items() if pid == e["pid"]]
            at = (e["ts"] - origin) / 1000
            if ranks_rows and low / 1000 <= at <= high / 1000:
                axes.vlines(
                    at,
                    min(ranks_rows) - 0.5,
                    max(ranks_rows) + 0.5,
                    color="#e6550d",
                    linewidth=0.3,
                    alpha=0.5,
                )
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            axes.axhline(i - 0.5, color="black", linewidth=0.8)
    labels = []
    for pid, tid in rows:
        tensor = names.get((pid, tid), str(tid))
        labels.append(f"rank {pid}: {tensor if len(tensor) <= 40 else '...' + tensor[-37:]}")
    axes.set_yticks(range(len(rows)), labels, fontsize=8)
    axes.invert_yaxis()
    right = max((s["end"] - origin) / 1000 for s in shown)
    axes.set_xlim(low / 1000, min(high / 1000, right))
    axes.set_xlabel("milliseconds")
    legend = [
        Patch(
            facecolor=_COLOURS["NEGOTIATE"],
            edgecolor="#4a4a4a",
            label="NEGOTIATE (waiting for the other ranks, agreement)",
        ),
        Patch(
            facecolor=_COLLECTIVE_COLOUR, edgecolor="#4a4a4a", label="collective (ALLREDUCE, ...)"
        ),
    ]
    legend += [Patch(facecolor=_COLOURS[p], label=p) for p in PHASES]
    legend.append(plt.Line2D([], [], color="black", label="fused: one collective"))
    axes.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.08),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    axes.set_title(title or os.path.basename(trace_path))
    figure.tight_layout()
    figure.savefig(image_path, dpi=110)
    plt.close(figure)


def main(argv=None):
    """`python -m keras_ring.timeline merge|plot ...`."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_ring.timeline", description="Merge and draw keras-ring timelines."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="join the ranks' files into one trace")
    merging.add_argument("path", help="the path the job recorded to (KERAS_RING_TIMELINE)")
    merging.add_argument("-o", "--output", help="where to write (default: path)")
    plotting = commands.add_parser("plot", help="draw a trace into an image (matplotlib)")
    plotting.add_argument("trace")
    plotting.add_argument("image")
    plotting.add_argument("--start-ms", type=float, default=None)
    plotting.add_argument("--duration-ms", type=float, default=None)
    plotting.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    if args.command == "merge":
        print(merge(args.path, args.output))
    else:
        plot(args.trace, args.image, args.start_ms, args.duration_ms, args.title)
        print(args.image)


if __name__ == "__main__":
    main()
