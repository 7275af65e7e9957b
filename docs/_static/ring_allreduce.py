"""Draws ring_allreduce.svg: the schedule of a ring allreduce on 3 ranks.

    python docs/_static/ring_allreduce.py

The contents of every block are computed by running the schedule of
custom_ops/core/algorithms.cc (reduce-scatter: at step s rank r sends block
r-1-s to rank r+1; allgather: at step s rank r sends block r-s), so the
picture cannot drift from the algorithm by a drawing mistake.
"""

import os

P = 3
BLOCK_W, BLOCK_H, GAP = 52, 30, 4
CELL_W = P * BLOCK_W + (P - 1) * GAP
COL_GAP, ROW_GAP = 34, 24
LEFT, TOP = 150, 78
SHADES = {1: "#dbe8f6", 2: "#8db6e3", 3: "#2f6db5"}  # blocks holding 1, 2 or 3 ranks' data


def schedule():
    """Yields (title, state, received) per column; state[r][c] is the set of ranks summed."""
    state = [[{r} for _ in range(P)] for r in range(P)]
    yield "start: each rank's gradients", state, set()
    for s in range(P - 1):
        old = [[set(b) for b in row] for row in state]
        received = set()
        for r in range(P):
            c = (r - 2 - s) % P
            state[r][c] = old[r][c] | old[(r - 1) % P][c]
            received.add((r, c))
        yield f"reduce-scatter step {s + 1}", state, received
    for s in range(P - 1):
        old = [[set(b) for b in row] for row in state]
        received = set()
        for r in range(P):
            c = (r - s - 1) % P
            state[r][c] = set(old[(r - 1) % P][c])
            received.add((r, c))
        yield f"allgather step {s + 1}", state, received


def svg():
    columns = [(t, [[set(b) for b in row] for row in s], set(rc)) for t, s, rc in schedule()]
    width = LEFT + len(columns) * (CELL_W + COL_GAP)
    height = TOP + P * (BLOCK_H + ROW_GAP) + 88
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#c0392b"/></marker></defs>',
        f'<text x="10" y="24" font-size="16" font-weight="bold">Ring allreduce, {P} ranks: '
        "reduce-scatter, then allgather</text>",
    ]
    # The ring itself, on the left: rank r sends to rank r+1, the last to rank 0.
    ys = [TOP + r * (BLOCK_H + ROW_GAP) + BLOCK_H / 2 for r in range(P)]
    for r, y in enumerate(ys):
        out.append(
            f'<text x="{LEFT - 12}" y="{y + 5}" font-size="13" text-anchor="end">rank {r}</text>'
        )
    x_ring = 40
    for r in range(P - 1):
        out.append(
            f'<line x1="{x_ring}" y1="{ys[r] + 6}" x2="{x_ring}" y2="{ys[r + 1] - 8}" '
            'stroke="#c0392b" stroke-width="2" marker-end="url(#arrow)"/>'
        )
    out.append(
        f'<path d="M{x_ring},{ys[-1]} C{x_ring - 30},{ys[-1]} {x_ring - 30},{ys[0]} '
        f'{x_ring - 4},{ys[0]}" fill="none" stroke="#c0392b" stroke-width="2" '
        'marker-end="url(#arrow)"/>'
    )
    for i, (title, state, received) in enumerate(columns):
        x0 = LEFT + i * (CELL_W + COL_GAP)
        out.append(
            f'<text x="{x0 + CELL_W / 2}" y="{TOP - 30}" font-size="12" '
            f'text-anchor="middle" font-weight="bold">{title}</text>'
        )
        for c in range(P):
            out.append(
                f'<text x="{x0 + c * (BLOCK_W + GAP) + BLOCK_W / 2}" y="{TOP - 10}" '
                f'font-size="11" text-anchor="middle" fill="#555">block {c}</text>'
            )
        for r in range(P):
            y = TOP + r * (BLOCK_H + ROW_GAP)
            for c in range(P):
                x = x0 + c * (BLOCK_W + GAP)
                ranks = state[r][c]
                edge = (
                    'stroke="#c0392b" stroke-width="3"'
                    if (r, c) in received
                    else 'stroke="#777" stroke-width="1"'
                )
                colour = "white" if len(ranks) == P else "black"
                out.append(
                    f'<rect x="{x}" y="{y}" width="{BLOCK_W}" height="{BLOCK_H}" '
                    f'fill="{SHADES[len(ranks)]}" {edge}/>'
                )
                out.append(
                    f'<text x="{x + BLOCK_W / 2}" y="{y + BLOCK_H / 2 + 4}" '
                    f'font-size="11" text-anchor="middle" fill="{colour}">'
                    f"{'+'.join(str(k) for k in sorted(ranks))}</text>"
                )
        if i in (1, P):
            # Phase boundaries: after the start column and after the reduce-scatter.
            xb = x0 + CELL_W + COL_GAP / 2 if i == P else x0 - COL_GAP / 2
            out.append(
                f'<line x1="{xb}" y1="{TOP - 46}" x2="{xb}" '
                f'y2="{TOP + P * (BLOCK_H + ROW_GAP) - 10}" stroke="#bbb" '
                'stroke-dasharray="4,4"/>'
            )
    legend_y = TOP + P * (BLOCK_H + ROW_GAP) + 14
    items = [
        (SHADES[1], "#777", "1", "one rank's data"),
        (SHADES[2], "#777", "0+1", "sum of two ranks"),
        (SHADES[3], "#777", "0+1+2", "complete sum"),
        ("white", "#c0392b", "", "received this step"),
    ]
    x = LEFT
    for fill, stroke, label, text in items:
        width_stroke = 3 if stroke == "#c0392b" else 1
        out.append(
            f'<rect x="{x}" y="{legend_y}" width="{BLOCK_W}" height="{BLOCK_H - 8}" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="{width_stroke}"/>'
        )
        colour = "white" if fill == SHADES[3] else "black"
        out.append(
            f'<text x="{x + BLOCK_W / 2}" y="{legend_y + 15}" font-size="10" '
            f'text-anchor="middle" fill="{colour}">{label}</text>'
        )
        out.append(f'<text x="{x + BLOCK_W + 6}" y="{legend_y + 15}" font-size="12">{text}</text>')
        x += BLOCK_W + 150
    notes = [
        "Labels name the ranks whose data a block holds. Red arrows: each rank sends to the next.",
        f"Every step, every rank sends one block (1/{P} of the buffer) and receives one: "
        f"2({P}-1) = {2 * (P - 1)} steps, {2 * (P - 1)}/{P} of the buffer sent per rank.",
    ]
    for k, note in enumerate(notes):
        out.append(f'<text x="10" y="{legend_y + 46 + 18 * k}" font-size="12">{note}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_allreduce.svg")
    with open(path, "w") as f:
        f.write(svg())
