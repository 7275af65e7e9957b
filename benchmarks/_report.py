"""Writing a benchmark's results: one JSON file and one PNG plot, under one stem."""

import json
import os


def write_results(out_dir, name, payload, **figure):
    """Writes `<out_dir>/<name>.json` and returns a Matplotlib (figure, axes) to draw on.

    Call `save_plot(fig, out_dir, name)` once drawn. `figure` goes to
    `plt.subplots` (figsize, nrows, ncols, ...).
    """
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(payload, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")  # no screen: files only
    import matplotlib.pyplot as plt

    return plt.subplots(**figure)


def save_plot(fig, out_dir, name):
    """Saves the figure as `<out_dir>/<name>.png` and says where both files are."""
    stem = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)
    print(f"wrote {stem}.json and {stem}.png")
