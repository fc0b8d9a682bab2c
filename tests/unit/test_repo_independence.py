"""The tests need nothing outside the repository: a clone alone passes (`.ci/run` runs them in a
copy with nothing beside it and GIGATRON_SHARED_DATA unset)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
DATA = TESTS / "data"
# Paths that lead out of the repository: the old sibling data directory, parent directories,
# this machine's layout.
OUTSIDE = re.compile(r"\.\./|(^|/)shared/|^/work/|^/home/|^~")
# Files whose outside paths are hostile inputs written into test folders (shard paths that must be
# refused), never read by the test itself.
HOSTILE_INPUTS = {TESTS / "e2e" / "test_convert_robustness.py"}


def test_the_data_directory_is_the_repositorys_own(shared_data):
    if "GIGATRON_SHARED_DATA" in os.environ:  # a deliberate override (never set by .ci/run)
        return
    assert shared_data.resolve() == DATA.resolve()


def test_no_test_names_a_path_outside_the_repository():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if DATA in path.parents or path == Path(__file__).resolve() or path in HOSTILE_INPUTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if OUTSIDE.search(node.value):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_every_data_file_has_its_source_listed():
    """Each file is named in tests/data/README.md, or lies in a folder named there (`name/`)
    that has a README.md of its own saying how its files were made."""
    readme = (DATA / "README.md").read_text()

    def listed(path: Path) -> bool:
        relative = path.relative_to(DATA)
        folders = [parent for parent in relative.parents if parent != Path(".")]
        described = any(f"{f}/" in readme and (DATA / f / "README.md").is_file() for f in folders)
        return str(relative) in readme or described

    unlisted = [
        str(path.relative_to(DATA))
        for path in sorted(DATA.rglob("*"))
        if path.is_file() and path.name != "README.md" and not listed(path)
    ]
    assert unlisted == []


def test_ci_runs_in_a_copy_with_nothing_beside_it():
    script = (REPO / ".ci" / "run").read_text()
    assert "unset GIGATRON_SHARED_DATA" in script and "mktemp -d" in script
    if os.environ.get("GIGATRON_CI_ISOLATED"):  # set by .ci/run: check the copy really is alone
        assert [entry.name for entry in REPO.parent.iterdir()] == [REPO.name]
        assert "GIGATRON_SHARED_DATA" not in os.environ
