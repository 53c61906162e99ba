"""`rlhfctl plot RUN_DIR [RUN_DIR...]`: the curves of one or more runs in one PNG.

Each run directory's `metrics.jsonl` (one JSON object a step, see rlhf_trainer/metrics.py)
becomes one line in every panel, against `step`, labelled with the directory's name (its
parent too where two runs share a name) and coloured the same in every panel.

Panels: the seven curves every RL run logs (`CURVES`) always, in that order; a panel whose
key no run logged is kept and says so, so that a sft run plotted beside a GRPO run shows
where its reward would be rather than shifting the grid. Then `OPTIONAL_CURVES` and every
`eval/<dataset>/<metric>` key, only when some run logged them; evaluations are drawn as
points at the evaluated steps. A run that lacks a panel's key is named in that panel.

Not done: smoothing, a log scale, wall-clock x axes, or reading TensorBoard/MLflow stores.
`None`, NaN and infinite values are skipped (a step without that value, not a zero).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

CURVES = (
    ("reward_mean", "reward"),
    ("kl", "KL"),
    ("entropy", "entropy"),
    ("response_length_mean", "response length (tokens)"),
    ("loss", "loss"),
    ("grad_norm", "grad norm"),
    ("step_seconds", "step time (s)"),
)
"""(key, title) of the panels every plot has, logged or not."""
OPTIONAL_CURVES = (("accuracy", "accuracy"), ("reward_margin", "reward margin"))
"""(key, title) of panels drawn only when some run logged the key (rm, dpo)."""
EVAL_PREFIX = "eval/"
COLUMNS = 3
PANEL_INCHES = (5.0, 3.6)
DPI = 100
"""The PNG is COLUMNS * 500 pixels wide and 360 pixels high per row of panels."""


class PlotError(ValueError):
    """A run directory cannot be plotted (the message says what to do): exit code 2."""


@dataclasses.dataclass(frozen=True)
class Line:
    """One run's curve in a panel: the steps and values of its rows that hold the key."""
    label: str
    steps: tuple[float, ...]
    values: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Panel:
    """One subplot: its key, title, one line per run that logged the key, and the labels of
    the runs that did not."""
    key: str
    title: str
    lines: tuple[Line, ...]
    missing: tuple[str, ...]
    points: bool = False
    """Evaluations: markers at the evaluated steps."""


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`; a last line still being written is ignored."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        what = "is not a directory" if not run_dir.is_dir() else "holds no metrics.jsonl"
        raise PlotError(f"{run_dir} {what}; run `rlhfctl run JOB.yaml --output {run_dir}` first, "
                        "or give the --output directory of a run")
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if isinstance(row, dict) and _number(row.get("step")) is not None:
            rows.append(row)
    if not rows:
        raise PlotError(f"{path} holds no steps yet; wait for the run's first step, or run "
                        f"`rlhfctl run JOB.yaml --output {run_dir}` first")
    return rows


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each directory's name; `parent/name` where names repeat; `#i` where even that does."""
    names = [p.name or str(p) for p in run_dirs]
    labels = [f"{p.parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]
    return [f"{label} #{i + 1}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]


def _series(rows: list[dict], key: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(steps, values) of the rows holding a finite number under `key` (absent, null, NaN
    and infinite values skipped)."""
    pairs = [(float(row["step"]), v) for row in rows if (v := _number(row.get(key))) is not None]
    return tuple(s for s, _ in pairs), tuple(v for _, v in pairs)


def build_panels(runs: dict[str, list[dict]]) -> list[Panel]:
    """The figure's structure, from {label: rows}: what `draw` renders and tests read."""
    keys = {k for rows in runs.values() for row in rows for k in row}
    evals = sorted(k for k in keys if k.startswith(EVAL_PREFIX) and k.count("/") >= 2)
    wanted = [(k, t, True) for k, t in CURVES]
    wanted += [(k, t, False) for k, t in OPTIONAL_CURVES if k in keys]
    wanted += [(k, k.removeprefix(EVAL_PREFIX), False) for k in evals]
    panels = []
    for key, title, always in wanted:
        lines, missing = [], []
        for label, rows in runs.items():
            steps, values = _series(rows, key)
            if steps:
                lines.append(Line(label, steps, values))
            else:
                missing.append(label)
        if lines or always:
            panels.append(Panel(key, title, tuple(lines), tuple(missing), points=key.startswith(EVAL_PREFIX)))
    return panels


def figure_size(num_panels: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG for this many panels."""
    num_rows = max(1, math.ceil(num_panels / COLUMNS))
    return round(COLUMNS * PANEL_INCHES[0] * DPI), round(num_rows * PANEL_INCHES[1] * DPI)


def draw(panels: list[Panel], labels: list[str]):
    """A matplotlib Figure (no pyplot state): one subplot per panel, in order,
    each line labelled with its run; one legend for the figure, above the panels."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    width, height = figure_size(len(panels))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    num_rows = max(1, math.ceil(len(panels) / COLUMNS))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(num_rows, COLUMNS, i + 1)
        ax.set_title(panel.title if panel.title == panel.key else f"{panel.title}  [{panel.key}]", fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        for line in panel.lines:
            marker = "o" if panel.points or len(line.steps) < 2 else None
            ax.plot(line.steps, line.values, label=line.label, color=colors[line.label],
                    marker=marker, markersize=4, linewidth=1.4)
        if not panel.lines:
            ax.text(0.5, 0.5, f"no run logged {panel.key}", transform=ax.transAxes,
                    ha="center", va="center", fontsize=10, color="0.4")
            ax.set_xticks([])
            ax.set_yticks([])
        elif panel.missing:
            # a legend of one text line, so that loc="best" keeps it off the curves
            ax.legend(handles=[Line2D([], [], linestyle="none")], labels=["not logged by: " + ", ".join(panel.missing)],
                      loc="best", handlelength=0, handletextpad=0, fontsize=8, labelcolor="0.35", framealpha=0.8)
    handles = [Line2D([], [], color=colors[label], linewidth=2, label=label) for label in labels]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(labels), 4), fontsize=9, frameon=False)
    return fig


def load_runs(run_dirs: list[str | Path]) -> dict[str, list[dict]]:
    """{label: rows} of these run directories, in order (PlotError if one cannot be read)."""
    if not run_dirs:
        raise PlotError("give at least one run directory")
    dirs = [Path(d) for d in run_dirs]
    rows = [read_rows(d) for d in dirs]
    return dict(zip(run_labels([d.resolve() for d in dirs]), rows))


def figure(run_dirs: list[str | Path]):
    """(panels, Figure) of these runs: the structure and the picture `plot_runs` saves."""
    runs = load_runs(run_dirs)
    panels = build_panels(runs)
    return panels, draw(panels, list(runs))


def plot_runs(run_dirs: list[str | Path], output: str | Path | None = None) -> Path:
    """Write the PNG of these runs to `output` (default `<first run>/plot.png`); its path.
    Raises PlotError when a run directory has no metrics.jsonl or no steps in it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    _, fig = figure(run_dirs)
    out = Path(output) if output is not None else Path(run_dirs[0]) / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=DPI, format="png")
    return out
