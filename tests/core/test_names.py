"""The value-name glossary (`nnterp.core.names`) is one line per name, in the names' own spelling.

Whether it covers exactly what the components serve is the contract test's (tests/test_contract.py).
"""

from __future__ import annotations

from nnterp.core import dims
from nnterp.core.names import VALUES


def test_each_name_is_an_identifier_with_one_line():
    for name, line in VALUES.items():
        assert name.isidentifier() and name == name.lower() and not name.startswith("_"), name
        assert line and line == line.strip() and "\n" not in line, name


def test_no_value_is_named_like_a_dimension():
    axes = {value for key, value in vars(dims).items() if key.isupper() and isinstance(value, str)}
    assert not axes & set(VALUES), "a value and an axis share a name"
