"""Off Linux, ddpnb says so before anything starts (issue 20: not an AttributeError from deep inside)."""

from __future__ import annotations

import sys

import pytest

import ddpnb


def noop() -> None:
    pass


@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_a_launch_off_linux_is_refused_saying_linux_only(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    # the one stand-in here: this machine is Linux, and another platform cannot exist on it
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(ddpnb.LaunchError, match=f"Linux only .* not on {platform}: run the Jupyter kernel in WSL2"):
        ddpnb.run(noop, nprocs=1)
    with pytest.raises(ddpnb.LaunchError, match="Linux only"):
        ddpnb.load_ipython_extension(None)  # %load_ext ddpnb: refused before it registers or starts anything
