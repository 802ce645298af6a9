"""The analysis's table files: one CSV convention, and older outputs read under today's column names."""

from __future__ import annotations

from pathlib import Path

from posfreq.analysis.table_files import markdown_table, read_csv, write_csv


def test_csv_round_trip_converts_numbers_and_empty_cells(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", [{"a": 1, "b": 0.5, "c": "x"}, {"a": 2}])
    assert path.read_text().splitlines() == ["a,b,c", "1,0.5,x", "2,,"]
    assert read_csv(path) == [{"a": 1, "b": 0.5, "c": "x"}, {"a": 2, "b": None, "c": None}]


def test_columns_of_older_outputs_are_read_under_their_new_names(tmp_path: Path) -> None:
    """Before the rename, the probe's tables called every token the weights saw `tokens_seen` and the run's
    own share `tokens_this_run`."""
    older = tmp_path / "effective_length.csv"
    older.write_text("checkpoint,tokens_seen,tokens_this_run\ntokens-1,1500,500\n")
    assert read_csv(older) == [
        {"checkpoint": "tokens-1", "tokens_trained": 1500, "run_tokens": 500}
    ]


def test_markdown_table_formats_each_cell_and_leaves_missing_ones_empty() -> None:
    table = markdown_table([{"a": 1.23456, "b": "x"}, {"a": 2}], ["a", "b"])
    assert table == "| a | b |\n|---|---|\n| 1.235 | x |\n| 2 |  |\n"
    assert markdown_table([{"a": None}], ["a"], cell=lambda v: "-" if v is None else str(v)) == (
        "| a |\n|---|\n| - |\n"
    )
