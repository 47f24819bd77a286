"""The loss curve (improved_diffusion/progress_plot.py) is a matplotlib plot a reader can read:
axis titles, plain tick numbers, a legend that says what q0..q3 are."""
from improved_diffusion import progress_plot


def test_the_loss_curve_has_axis_titles_plain_ticks_and_a_legend_explaining_the_quartiles():
    series = {k: [(s, (i + 1) * 0.1 / s ** 0.3) for s in range(10, 210, 10)]
              for i, k in enumerate(progress_plot.QUARTILE_KEYS)}
    fig = progress_plot.loss_figure(series, marks=[(100, "preempted, resumed")])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    (ax,) = fig.axes
    assert ax.get_xlabel() == "training step"
    assert "loss" in ax.get_ylabel() and ax.get_yscale() == "log"
    legend = ax.get_legend()
    assert "quarter of the timestep range" in legend.get_title().get_text()
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[0].startswith("q0: timesteps 0-25% of T") and "least noise" in texts[0]
    assert texts[3].startswith("q3: timesteps 75-100% of T") and "most noise" in texts[3]
    # tick labels are plain numbers (no 6 x 10^-2), steps are round numbers
    ylabels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert ylabels and all(float(t) > 0 for t in ylabels), ylabels
    xticks = [t for t in ax.get_xticks() if 10 <= t <= 200]
    gaps = {b - a for a, b in zip(xticks, xticks[1:])}
    assert len(gaps) == 1 and gaps.pop() in (10, 20, 25, 50), xticks
    assert any("preempted, resumed at step 100" == t.get_text() for t in ax.texts)
