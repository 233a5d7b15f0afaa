"""A family added in a later transformers release is reported absent from an older one, not failed.

``tests/families/test_<model_type>.py`` imports its transformers modeling module
at the top; on a release without it, the file is collected as one skip naming
the release (`nnterp.families.absent`), instead of an import error.
"""

from __future__ import annotations

import pytest

from nnterp.families import REGISTRY, absent


class AbsentFamily(pytest.Module):
    """A family's test file on a transformers release that lacks the family."""

    def collect(self):
        pytest.skip(absent(self.path.stem.removeprefix("test_")), allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    model_type = module_path.stem.removeprefix("test_")
    if model_type in REGISTRY and absent(model_type) is not None:
        return AbsentFamily.from_parent(parent, path=module_path)
    return None
