"""A connection's conformance profiles, applied to each message it receives (docs/profiles.md).

`Conformance` is built once per connection when the config is loaded. Every transport's
`build_inbound` hands it the decoded text: with no finding the message goes on as before; with
findings, ``reject`` refuses it (`ProfileRefused`: an ``AR`` with one ERR a finding — resending it
unchanged cannot help, which is what ``AR`` means here — and nothing staged), ``flag`` stages it with
its findings (the JSON of `include.profiles.check.findings_json`, stored beside the row).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from include.profiles.check import Finding, findings_json, survey
from include.profiles.load import Profile, ProfileError, read_profiles
from listeners.hl7errors import Condition, Location

__all__ = ["Conformance", "ProfileRefused", "conditions_of", "profile_paths", "read_conformance"]


class ProfileRefused(ValueError):
    """A message with findings on a ``reject`` connection: ``findings`` are its ERRs."""

    def __init__(self, found: Sequence[Finding], total: int = 0) -> None:
        total = max(total, len(found))
        unlisted = f": {total - len(found)} not listed" if total > len(found) else ""
        more = f" (and {total - 1} more{unlisted})" if total > 1 else ""
        super().__init__(f"profile: {found[0].text}{more}")
        self.findings = tuple(found)
        self.total = total  # every finding, the ones past the ERRs' cap too


class Conformance:
    """The profiles of one connection and what a departure gets (``reject`` or ``flag``)."""

    def __init__(self, profiles: tuple[Profile, ...], mode: str, digest: str) -> None:
        self.profiles = profiles
        self.mode = mode
        self.digest = digest  # of the profile files' bytes: a changed profile is a changed config

    def check(self, text: str) -> str | None:
        """None when `text` conforms; the findings' JSON to stage with it when flagging; raises
        `ProfileRefused` when rejecting."""
        found = survey(text, self.profiles)
        if not found:
            return None
        if self.mode == "reject":
            raise ProfileRefused(found, found.total)
        return findings_json(found)


def conditions_of(found: Sequence[Finding]) -> list[tuple[Condition, str]]:
    """Each finding as the ERR an ACK carries: (table 0357 code at its ERL, its text)."""
    return [
        (Condition(f.code, Location(f.segment, f.sequence, f.field, f.component, f.repetition)), f.text) for f in found
    ]


def profile_paths(value: str | list[str], base: Path) -> tuple[str, ...]:
    """A connection's `profile` key as absolute paths (relative ones are to the config dir)."""
    names = [value] if isinstance(value, str) else value
    return tuple(str((base / name).resolve()) for name in names if name)


def read_conformance(paths: tuple[str, ...], mode: str, config_dir: Path) -> Conformance | None:
    """The connection's profiles read and checked (None: no profile, or ``off``); ValueError with
    the profile file's problems otherwise. Lookup tables come from `<config_dir>/lookups/`."""
    if not paths or mode == "off":
        return None
    try:
        profiles = read_profiles([Path(p) for p in paths], lookups=config_dir / "lookups")
    except ProfileError as exc:
        raise ValueError(str(exc)) from None
    digest = hashlib.sha256()
    for source in sorted({s for profile in profiles for s in profile.sources}):
        digest.update(str(source).encode() + b"\0" + source.read_bytes())
    return Conformance(profiles, mode, digest.hexdigest()[:16])
