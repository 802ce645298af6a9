import matplotlib.pyplot as plt
import pytest

from posfreq.analysis.plots.frequency import save_figure


@pytest.mark.slow
def test_a_figure_saved_twice_is_the_same_bytes(tmp_path):
    """A rerun that reuses every result redraws its figures: without a creation date in the PDF they come out
    byte-identical, so a rerun changes no file it has no reason to."""
    saved = []
    for name in ("a", "b"):
        fig, ax = plt.subplots()
        ax.plot([1, 3, 2])
        paths = save_figure(fig, tmp_path / name / "fig")
        assert [p.suffix for p in paths] == [".png", ".pdf"]
        saved.append([p.read_bytes() for p in paths])
    assert b"/CreationDate" not in saved[0][1]
    assert saved[0] == saved[1]
