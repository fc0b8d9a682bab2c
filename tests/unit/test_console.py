"""Warnings as one clean line each, shown by rank 0 only."""

from __future__ import annotations

import io
import warnings

from gigatron.console import one_line_warnings


def test_a_warning_is_one_line_without_source(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    with warnings.catch_warnings(), one_line_warnings(out):
        warnings.simplefilter("always")
        warnings.warn("--split not given; using the default", stacklevel=1)
        warnings.warn("old", DeprecationWarning, stacklevel=1)
    assert out.getvalue() == (
        "warning: --split not given; using the default\nwarning: DeprecationWarning: old\n"
    )


def test_only_rank_0_shows_warnings(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    out = io.StringIO()
    with warnings.catch_warnings(), one_line_warnings(out):
        warnings.simplefilter("always")
        warnings.warn("every rank says this", stacklevel=1)
    assert out.getvalue() == ""
