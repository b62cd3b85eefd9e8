"""Reading JSON files that users hand in (plans, hardware profiles, checkpoint records):
data only, with a size and a nesting-depth bound, every failure one sentence naming the file."""

from __future__ import annotations

import json
import os

from autopar.errors import AutoparError

MAX_BYTES = 64 * 2**20  # far above any plan, profile or checkpoint record autopar writes
MAX_DEPTH = 32  # autopar's own files (plans, profiles, checkpoint records) nest 2 to 4 deep


def read_json(path, what: str, error: type[AutoparError], fix: str,
              max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """The value in the JSON file `path` (`what` names it in errors, `fix` says what would
    work), refused with `error` when unreadable, too large, too deep or not JSON."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"the {what} {path} could not be read ({e.strerror or e}); {fix}.") from e
    if len(raw) > max_bytes:
        raise error(f"the {what} {path} is larger than {max_bytes} bytes, more than any "
                    f"file autopar writes; {fix}.")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"the {what} {path} is not UTF-8 text (byte {e.start}); {fix}.") from e
    except json.JSONDecodeError as e:
        raise error(f"the {what} {path} is not valid JSON ({e.msg} at line {e.lineno} "
                    f"column {e.colno}: truncated or not written by autopar); {fix}.") from e
    except RecursionError as e:
        raise error(f"the {what} {path} nests deeper than {max_depth} levels; {fix}.") from e
    if _depth(value) > max_depth:
        raise error(f"the {what} {path} nests deeper than {max_depth} levels; {fix}.")
    return value


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), walked without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level + 1)
        todo.extend((child, level + 1) for child in item)
    return deepest
