"""``maskserve up --share``: refused without the login; a share server that cannot be reached is
reported (the studio keeps serving), never a crash."""

from __future__ import annotations

import threading

import pytest

from backend.cli import main
from backend.config import load_settings
from backend.services.redis_server import free_port
from studio.share import open_share_link, share_url_path, wait_for_share_url


def test_share_without_the_login_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASKSERVE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MASKSERVE_AUTH_DISABLED", "1")
    assert main(["up", "--share"]) == 2
    assert "needs the login" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unreachable_share_server_is_reported_not_fatal(tmp_path):
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = load_settings(
        env={}, paths={"data_dir": str(tmp_path)}, studio={"share": True, "share_server": closed}
    )
    thread = open_share_link(settings, lambda: True)
    thread.join(timeout=60)
    assert not thread.is_alive()
    outcome = wait_for_share_url(settings, threading.Event(), timeout_s=1)
    assert outcome.startswith("error: no share link") and "internet" in outcome
    assert share_url_path(settings).read_text() == outcome


def test_waiting_for_a_link_that_never_comes_says_where_to_look(tmp_path):
    settings = load_settings(env={}, paths={"data_dir": str(tmp_path)})
    assert "see the api log" in wait_for_share_url(settings, threading.Event(), timeout_s=0.3)


@pytest.mark.parametrize("path", ["studio", "/", "/v1", "/a//b"])
def test_a_bad_studio_path_is_refused_at_start_up(path):
    from backend.config import SettingsError

    with pytest.raises(SettingsError, match="studio path"):
        load_settings(env={"MASKSERVE_STUDIO_PATH": path})
