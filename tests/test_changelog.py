"""The changelog is release notes for users of ``backend="piecewise"``: short, about what they see,
never about private modules; its newest release is the package's version."""

import pathlib
import re

import piecewise_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
#: The package's folders and modules, by path or dotted (``runtime/capture_decisions.py``,
#: ``piecewise_backend.runtime.stats``): what a user cannot act on. Public modules (``ops``) may be named.
PRIVATE = sorted(
    p.name if p.is_dir() else p.stem
    for p in (ROOT / "piecewise_backend").iterdir()
    if (p.is_dir() and (p / "__init__.py").exists() and p.name != "ops") or (p.suffix == ".py" and p.stem != "__init__")
)


def private_module_mentions(text: str) -> list[str]:
    folders = "|".join(re.escape(name) for name in PRIVATE)
    pattern = re.compile(rf"piecewise_backend/|\b(?:{folders})/|piecewise_backend\.(?:{folders})\b|\b\w+\.py\b")
    return [line for line in text.splitlines() if pattern.search(line)]


def test_the_changelog_is_short_and_names_no_private_module():
    assert len(CHANGELOG.encode()) <= 12_000
    assert private_module_mentions(CHANGELOG) == []


def test_the_check_catches_a_private_module_by_path_or_by_name():
    lines = [
        "- `runtime/capture_decisions.py`: every choice in one object.",
        "- stats moved to `piecewise_backend.observe.reports`.",
        "- `piecewise_backend/backend.py` builds the plan.",
        "- `piecewise_backend.ops.paged_decode_attention` is faster.",  # public: allowed
    ]
    assert private_module_mentions("\n".join(lines)) == lines[:3]


def test_the_newest_release_is_the_package_version_and_keeps_a_changelog_sections():
    releases = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d\d-\d\d))?$", CHANGELOG, re.M)
    assert releases[0] == ("Unreleased", "")
    assert releases[1][0] == piecewise_backend.__version__ and releases[1][1]
    headings = set(re.findall(r"^### (\w+)$", CHANGELOG, re.M))
    assert headings <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
