"""The library versions every patch in this folder was checked on: one table for the whole pack.

Each patch replaces a private function written for particular releases. `guard.target` refuses to apply a patch,
with one line, when an installed library is outside its range here (a signature can stay the same while the code
behind it changes), and when the function's signature changed. `make test-compat` runs the suite at both ends of
these ranges (README, "Tested versions"); pyproject.toml allows exactly these ranges for the patched libraries
(tests/test_patches.py keeps the two equal), so a widened range must first pass `make test-compat`.

A version that needs a code path of its own gets it here (a helper keyed on `installed(...)`), not in the patches.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

CHECKED = {
    "torch": ">=2.11,<2.16",
    "transformers": ">=5.17,<5.25",
    "trl": ">=1.16,<1.17",
    "peft": ">=0.21,<0.22",
    "accelerate": ">=1.15,<1.16",
}


def checked_on(*libraries: str) -> dict[str, str]:
    """The ranges of `libraries`, for a patch's `guard.target(..., checked_on=...)`."""
    return {lib: CHECKED[lib] for lib in libraries}


def installed(library: str) -> Version | None:
    try:
        return Version(version(library))
    except PackageNotFoundError:
        return None


def outside(ranges: dict[str, str]) -> list[str]:
    """`lib version` for every installed library of `ranges` outside its range (local builds such as 2.13.0+cpu
    and release candidates count as their release)."""
    found = []
    for lib, spec in ranges.items():
        have = installed(lib)
        if have is not None and not SpecifierSet(spec).contains(have, prereleases=True):
            found.append(f"{lib} {have}")
    return found
