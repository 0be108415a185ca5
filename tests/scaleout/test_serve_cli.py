"""`isolab serve --replicas` refuses in one sentence when Ray is missing or a flag needs another."""

from __future__ import annotations

import sys

from isolab.cli import main


def test_replicas_without_ray_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as on a machine without the extra
    assert main(["serve", "--replicas", "2", "--no-auth"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'isolab[ray]'" in err and "Traceback" not in err


def test_ray_flags_need_replicas(capsys):
    assert main(["serve", "--ray-address", "auto", "--no-auth"]) == 2
    assert "need --replicas N" in capsys.readouterr().err
    assert main(["serve", "--replica-threads", "2", "--no-auth"]) == 2
    capsys.readouterr()
    assert main(["serve", "--replicas", "0", "--no-auth"]) == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


def test_ray_client_addresses_are_refused_in_one_sentence(capsys):
    import pytest

    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    assert main(["serve", "--replicas", "1", "--ray-address", "ray://head:10001", "--no-auth"]) == 2
    err = capsys.readouterr().err
    assert "Ray Client" in err and "--ray-address auto" in err and "Traceback" not in err
