"""Hypothesis's pytest plugin writes a patch with the failing example after a failure; with
Twisted's zope.interface classes imported, its code rewriter (libcst) raises while doing so and
pytest stops the whole session with an INTERNALERROR instead of reporting the failure. The
failure itself is reported in full without the patch."""

from __future__ import annotations

try:
    import hypothesis.extra._patching as _patching
except ImportError:  # pragma: no cover - an older hypothesis without patches
    _patching = None

if _patching is not None:
    _patching.get_patch_for = lambda *args, **kwargs: None
