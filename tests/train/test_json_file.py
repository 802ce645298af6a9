import math

import pytest

from posfreq.train.json_file import read_json_object


class Refused(ValueError):
    pass


@pytest.mark.parametrize(
    "content, says",
    [
        (b'{"a": 1', "is not valid JSON"),
        (b'{"a": "\xff"}', "is not UTF-8 text (byte 0xff at offset 7)"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b"[" * 100_000, "is not valid JSON"),  # nested past the parser's depth
    ],
)
def test_a_damaged_file_is_one_error_of_the_callers_type_naming_file_and_fix(
    tmp_path, content, says
):
    path = tmp_path / "meta.json"
    path.write_bytes(content)
    with pytest.raises(Refused) as err:
        read_json_object(path, Refused, "Fix: do this", "the run's state")
    assert str(err.value).startswith(f"{path} (the run's state) ")
    assert says in str(err.value) and str(err.value).endswith("Fix: do this")


def test_a_missing_file_names_the_reason_and_an_object_is_returned(tmp_path):
    with pytest.raises(
        Refused, match=r"gone\.json cannot be read \(No such file or directory\)\. Fix"
    ):
        read_json_object(tmp_path / "gone.json", Refused, "Fix: x")
    (tmp_path / "ok.json").write_text('{"a": [1, {"b": null}]}')
    assert read_json_object(tmp_path / "ok.json", Refused, "Fix: x") == {"a": [1, {"b": None}]}


def test_finite_numbers_refuses_what_json_can_smuggle_in_as_a_number() -> None:
    from posfreq.train.json_file import finite_numbers

    assert finite_numbers([0, 0.5, 1.0], 3, 0.0, 1.0)
    assert finite_numbers([-3.0, 0.0], 2, -math.inf, 0.0)
    for bad in (
        [0.5, 0.5],
        [0.5, 2.0, 0.1],
        [True, 0.5, 0.5],
        [float("nan")] * 3,
        ["1", 0, 0],
        None,
        (0, 0, 0),
    ):
        assert not finite_numbers(bad, 3, 0.0, 1.0), bad
    assert not finite_numbers([-math.inf, 0.0], 2, -math.inf, 0.0)  # in range, but not finite
