"""What a fresh install gets: pyproject.toml's ranges, the tested releases that
scripts/setup.sh installs (scripts/constraints.txt), and transformers only where the local
sampler's fast path was tested."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from retool.config import tomllib  # tomli on Python 3.10
from retool.engines.local import hf_compat

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def dependencies() -> dict[str, Requirement]:
    extras = [d for group in PROJECT["optional-dependencies"].values() for d in group]
    return {canonicalize_name(r.name): r for r in map(Requirement, PROJECT["dependencies"] + extras)
            if r.marker is None or r.marker.evaluate()}


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_the_package_allows_exactly_the_tested_transformers_range():
    """A fresh `pip install retool-rl` never picks a release the fast path was not tested on."""
    low, high = hf_compat.TESTED_TRANSFORMERS
    assert {str(s) for s in dependencies()["transformers"].specifier} == {f">={low}", f"<={high}"}


def test_setup_installs_under_the_constraints():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "-c scripts/constraints.txt" in setup and '"${CONSTRAINTS[@]}" -e ".[test]"' in setup


def test_every_pinned_dependency_is_one_pyproject_allows():
    pins, deps = constraints(), dependencies()
    assert "transformers" in pins and hf_compat.is_tested(str(pins["transformers"]))
    assert "torch" not in pins  # setup.sh pins the CPU wheel itself
    for name, requirement in deps.items():
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    assert {"peft", "accelerate", "tokenizers", "math-verify", "pytest"} <= pins.keys()
