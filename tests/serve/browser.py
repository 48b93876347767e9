"""Headless chromium for the chat page's tests: Debian's build, driven by playwright.

Playwright is told the system browser's path, so it never downloads one of its
own. Where either is missing, or the browser does not start, the test is
skipped with the reason.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p is not None), None)


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A playwright Browser on the system chromium, or a skip naming what is missing."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (it is in the test extra)")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium on PATH (./run test installs Debian's where apt-get runs as root)")
    with sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=path, headless=True)
        except sync_api.Error as exc:
            pytest.skip(f"chromium at {path} did not start: {str(exc).splitlines()[0]}")
        try:
            yield browser
        finally:
            browser.close()
