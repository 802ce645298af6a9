"""Reading a JSON object a user or an earlier run left on disk: every way the file can be wrong (unreadable, not
UTF-8, not JSON, not an object) is one error of the caller's type naming the file and the caller's fix; and
checking the numbers such a file holds."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_json_object(
    path: str | Path, error: type[Exception], fix: str, what: str | None = None
) -> dict:
    """The JSON object in `path`; otherwise `error` (a message naming the file, `what` it holds if given, what is
    wrong with it, then `fix`)."""
    name = f"{path} ({what})" if what else str(path)
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as err:
        raise error(f"{name} cannot be read ({err.strerror or err}). {fix}") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{name} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}). {fix}"
        ) from None
    except (ValueError, RecursionError) as err:  # not JSON, or nested past the parser's depth
        raise error(f"{name} is not valid JSON ({err}). {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{name} holds a JSON {type(data).__name__}, not an object. {fix}")
    return data


def finite_numbers(values: object, count: int, low: float, high: float) -> bool:
    """Whether `values` (read from JSON) is a list of `count` finite numbers in [low, high]: NaN, infinities,
    booleans and strings are not."""
    return (
        isinstance(values, list)
        and len(values) == count
        and all(
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            and low <= v <= high
            for v in values
        )
    )
