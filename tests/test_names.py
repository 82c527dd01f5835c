"""Machine names become NATS subject tokens: anything that could escape a subject is refused."""

import pytest

from mesh.names import InvalidName, check_name


@pytest.mark.parametrize("name", ["node-1", "a", "Node_2", "x" * 64, "0abc"])
def test_valid_names_pass(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "must not be empty"),
        ("a.b", "not a valid name"),
        ("node*", "not a valid name"),
        (">", "not a valid name"),
        ("with space", "not a valid name"),
        ("-leading", "not a valid name"),
        ("x" * 65, "at most 64"),
    ],
)
def test_invalid_names_are_refused_with_the_field_and_value(name: str, why: str) -> None:
    with pytest.raises(InvalidName) as refused:
        check_name(name, field="--name")
    assert why in str(refused.value)
    assert str(refused.value).startswith("--name:")
