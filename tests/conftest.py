"""Shared fixtures."""

import pytest

PAGE_SIZES = [1, 4]


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"page{ps}")
def page_size(request):
    """Each test that takes it runs with page_size 1 (token slots) and 4 (pages)."""
    return request.param
