"""Input schema versions are checked where inputs are decoded (issue 10, finding 7)."""

from __future__ import annotations

import msgspec
import pytest

from shared.fence.schema import (
    SCHEMA_VERSION,
    CommandResult,
    Fence,
    Inventoried,
    Observed,
    UnknownVersion,
    decode_input,
    encode,
)


@pytest.mark.parametrize("v", [0, -1, SCHEMA_VERSION + 1, 2**64 - 1])
def test_an_input_of_an_unknown_version_is_refused(v: int) -> None:
    data = encode(msgspec.structs.replace(Observed("default/a", "u1", 1), v=v))
    with pytest.raises(UnknownVersion, match=f"schema version {v}"):
        decode_input(data)


def test_a_survey_find_of_an_unknown_version_is_refused() -> None:
    fence = Fence("default/a", "u1", 1)
    find = msgspec.structs.replace(Inventoried(fence, "host-a", "vm-1", "running"), v=SCHEMA_VERSION + 1)
    data = encode(CommandResult(fence, "c1", "survey", "host-a", "survey", "ok", found=[find]))
    with pytest.raises(UnknownVersion):
        decode_input(data)


def test_the_current_version_decodes() -> None:
    obs = Observed("default/a", "u1", 1)
    assert decode_input(encode(obs)) == obs
