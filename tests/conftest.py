"""Every test runs with a home of its own: lnfuse makes its per-user key (``lnfuse.userkey``) in the config folder
at first need, and a test must never read or write the real one. Child processes (the CLI, workers) inherit it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.delenv("LNFUSE_KEY_FILE", raising=False)
