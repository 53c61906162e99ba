"""`rlhfctl plot`: two runs' metrics.jsonl written here (one without `kl`, neither with
`response_length_mean`), drawn through the CLI; the PNG read back, and the figure's
panels and lines checked against the rows; the errors a user can cause; and local mode's
`save_plot`, which prints where the picture is and only warns when it cannot draw."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from rich.console import Console

from rlhf_launcher.cli import main
from rlhf_launcher.local import save_plot
from rlhf_launcher.plot import figure, run_labels

EVAL = "eval/gsm8k/greedy_score"


def alpha_rows() -> list[dict]:
    """12 steps; a NaN loss at step 3, no grad_norm key at step 5, evaluations at 1, 6, 12."""
    rows = []
    for s in range(1, 13):
        row = {"step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s, "entropy": 3.0 - 0.2 * s,
               "loss": float("nan") if s == 3 else 1.0 / s, "grad_norm": 0.5 + 0.01 * s,
               "step_seconds": 2.0, "accuracy": 0.05 * s, EVAL: 0.1 * s if s in (1, 6, 12) else None}
        if s == 5:
            del row["grad_norm"]
        rows.append(row)
    return rows


def beta_rows() -> list[dict]:
    """8 steps, no `kl` key, an infinite step time at step 2, evaluations at 4 and 8."""
    return [{"step": s, "reward_mean": 0.5 - 0.05 * s, "entropy": 1.0 + 0.1 * s, "loss": 2.0 - 0.1 * s,
             "grad_norm": 1.5, "step_seconds": math.inf if s == 2 else 1.0 + s,
             EVAL: 0.3 * s if s % 4 == 0 else None} for s in range(1, 9)]


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [write_run(tmp_path / "alpha", alpha_rows()), write_run(tmp_path / "beta", beta_rows())]


def test_cli_writes_a_png_with_a_panel_per_curve(runs, tmp_path, capsys):
    out = tmp_path / "pics" / "cmp.png"
    assert main(["plot", *map(str, runs), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    image = imread(out)  # fails unless it is a PNG
    # 7 fixed panels + accuracy + the eval curve = 9, 3 columns: 3 rows of 360 px, 1500 px wide
    assert image.shape == (1080, 1500, 4)
    rgb = (image[..., :3] * 255).round()
    for color in ((31, 119, 180), (255, 127, 14)):  # C0 (alpha) and C1 (beta) are drawn
        assert np.all(np.abs(rgb - color) < 3, axis=-1).sum() > 500

    panels, fig = figure(runs)
    assert [p.key for p in panels] == ["reward_mean", "kl", "entropy", "response_length_mean", "loss",
                                       "grad_norm", "step_seconds", "accuracy", EVAL]
    assert len(fig.axes) == 9  # the legend is the figure's, not a panel
    assert [ax.get_title() for ax in fig.axes[:2]] == ["reward  [reward_mean]", "KL  [kl]"]
    assert fig.axes[-1].get_title() == f"gsm8k/greedy_score  [{EVAL}]"
    for panel, ax in zip(panels, fig.axes):
        drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        assert drawn == {line.label: (list(line.steps), list(line.values)) for line in panel.lines}


def steps_values(panels, key: str, label: str) -> tuple[list[float], list[float]]:
    (line,) = [line for p in panels if p.key == key for line in p.lines if line.label == label]
    return list(line.steps), list(line.values)


def test_lines_hold_exactly_the_rows_finite_values(runs):
    panels, fig = figure(runs)
    a, b = alpha_rows(), beta_rows()
    assert steps_values(panels, "reward_mean", "alpha") == ([r["step"] for r in a], [r["reward_mean"] for r in a])
    assert steps_values(panels, "reward_mean", "beta") == ([r["step"] for r in b], [r["reward_mean"] for r in b])
    assert steps_values(panels, "loss", "alpha")[0] == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # NaN skipped
    assert steps_values(panels, "grad_norm", "alpha")[0] == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]  # key absent
    assert steps_values(panels, "step_seconds", "beta") == ([1, 3, 4, 5, 6, 7, 8], [2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    assert steps_values(panels, EVAL, "alpha") == ([1, 6, 12], [a[i][EVAL] for i in (0, 5, 11)])
    assert steps_values(panels, EVAL, "beta") == ([4, 8], [b[3][EVAL], b[7][EVAL]])

    eval_ax = fig.axes[[p.key for p in panels].index(EVAL)]
    assert all(line.get_marker() == "o" for line in eval_ax.get_lines())  # points at the evaluated steps
    colors = {line.get_label(): line.get_color() for ax in fig.axes for line in ax.get_lines()}
    assert colors == {"alpha": "C0", "beta": "C1"}  # one colour a run, in every panel
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["alpha", "beta"]


def notes(ax) -> list[str]:
    """The text a panel shows besides its curves: its own texts and its legend's."""
    legend = ax.get_legend()
    return [t.get_text() for t in ax.texts] + ([t.get_text() for t in legend.get_texts()] if legend else [])


def test_a_key_not_logged_is_reported_in_its_panel(runs):
    panels, fig = figure(runs)
    index = {p.key: i for i, p in enumerate(panels)}
    kl, kl_ax = panels[index["kl"]], fig.axes[index["kl"]]
    assert [line.label for line in kl.lines] == ["alpha"] and kl.missing == ("beta",)
    assert notes(kl_ax) == ["not logged by: beta"]
    length = panels[index["response_length_mean"]]
    assert length.lines == () and length.missing == ("alpha", "beta")
    assert notes(fig.axes[index["response_length_mean"]]) == ["no run logged response_length_mean"]
    assert notes(fig.axes[index["reward_mean"]]) == []  # both logged it: no note
    assert panels[index["accuracy"]].missing == ("beta",)


def test_default_output_is_in_the_first_run(runs, capsys):
    assert main(["plot", str(runs[1]), str(runs[0])]) == 0
    assert capsys.readouterr().out.strip() == str(runs[1] / "plot.png")
    assert imread(runs[1] / "plot.png").shape[1] == 1500
    assert not (runs[0] / "plot.png").exists()


def test_equal_names_are_told_apart_by_their_parent(tmp_path):
    assert run_labels([Path("/x/a/run"), Path("/x/b/run"), Path("/x/b/other")]) == ["a/run", "b/run", "other"]
    runs = [write_run(tmp_path / "a" / "run", beta_rows()), write_run(tmp_path / "b" / "run", alpha_rows())]
    panels, _ = figure(runs)
    assert [line.label for line in panels[0].lines] == ["a/run", "b/run"]


@pytest.mark.parametrize("case", ["no metrics.jsonl", "empty", "not a directory"])
def test_unplottable_run_dir_exits_2_naming_it(runs, tmp_path, capsys, case):
    bad = tmp_path / "bad"
    if case != "not a directory":
        bad.mkdir()
    if case == "empty":
        (bad / "metrics.jsonl").write_text("")
    out = tmp_path / "never.png"
    assert main(["plot", str(runs[0]), str(bad), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "rlhfctl run JOB.yaml --output" in err
    assert ("no steps" in err) == (case == "empty")
    assert not out.exists()  # nothing half-drawn


def test_local_mode_prints_where_the_plot_is(runs):
    text = io.StringIO()
    path = save_plot(runs[0], Console(file=text, width=500))
    assert path == runs[0] / "plot.png" and imread(path).shape == (1080, 1500, 4)
    assert text.getvalue().strip() == f"plot: {path}"


def test_local_mode_only_warns_when_it_cannot_draw(tmp_path):
    text = io.StringIO()
    (tmp_path / "metrics.jsonl").write_text("")  # a run that logged no step
    assert save_plot(tmp_path, Console(file=text, width=500)) is None
    assert text.getvalue().startswith(f"warning: could not draw {tmp_path / 'plot.png'}")
    assert not (tmp_path / "plot.png").exists()
