"""`isolab serve --replicas` refuses in one sentence when Ray is missing or a flag needs another."""

from __future__ import annotations

import re
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


def test_replica_flags_out_of_range_are_refused_before_ray_starts(capsys):
    """Found by a black-box QA pass (session 42): --replicas 100000 took 16 GB in a minute, a zero
    thread count was taken as the default, a negative CPU count failed inside Ray seven seconds on,
    and a replica's missing model reached only Ray's controller log."""
    import pytest

    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    for flags, says in ((["--replicas", "100000"], "--replicas 100000 is more than"),
                        (["--replicas", "2", "--replica-threads", "0"], "--replica-threads must be at least 1, not 0"),
                        (["--replicas", "2", "--replica-cpus", "-1"], "--replica-cpus must be more than 0"),
                        (["--replicas", "2", "--replica-gpus", "-1"], "--replica-gpus must be 0 or more"),
                        (["--replicas", "2", "--model", "/nonexistent.gguf"], "model file '/nonexistent.gguf' does not exist"),
                        (["--replicas", "2", "--ray-address", "garbage"], "give HOST:PORT of the cluster's head"),
                        (["--replicas", "2", "--ray-address", "127.0.0.1:1"], "nothing answers there")):
        assert main(["serve", "--no-auth", "--port", "0", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (flags, err)


def test_a_ctrl_c_while_replicas_start_removes_them(monkeypatch):
    """On a joined cluster the replicas outlive the server: a KeyboardInterrupt during the start (it
    escaped `except Exception`) must tear down what started, then go on as a Ctrl-C."""
    import types

    import pytest

    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import ray

    from isolab.config import build_engine_config
    from isolab.scaleout import deploy as d

    torn: list[tuple[str, bool]] = []

    def start(**_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(d, "require_ray", lambda: types.SimpleNamespace(start=start))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # joined: nothing to init here
    monkeypatch.setattr(d, "_teardown", lambda prefix, local: torn.append((prefix, local)))
    with pytest.raises(KeyboardInterrupt):
        d.deploy(build_engine_config(), d.ScaleOut(replicas=1, threads_per_replica=1, ray_address="auto"), 8)
    assert len(torn) == 1 and torn[0][0].startswith("isolab-") and torn[0][1] is False


def _app(status: str, message: str = "", deployment_message: str = ""):
    import types

    return types.SimpleNamespace(status=status, message=message,
                                 deployments={"engine": types.SimpleNamespace(message=deployment_message)})


class _Serve:
    """serve.status() giving each poll's applications in turn (the last one repeated)."""

    def __init__(self, polls):
        self.polls = list(polls)

    def status(self):
        import types

        return types.SimpleNamespace(applications=self.polls.pop(0) if len(self.polls) > 1 else self.polls[0])


# What Ray 2.60 sets on a deployment whose constructor fails: the app's message names no reason, the
# deployment's ends with the traceback (serve/_private/application_state.py, deployment_state.py)
RAY_FAILED = {"message": "Failed to update the deployments ['engine'].",
              "deployment_message": "The deployment failed to start 3 times in a row. This may be due to a problem "
                                    "with its constructor or initial health check failing. See controller logs for "
                                    "details. Error:\nTraceback (most recent call last):\n  File \"replica.py\", "
                                    "line 40, in __init__\n    raise ValueError('bad model')\nValueError: bad model"}


def test_a_start_that_waits_for_room_says_why_and_a_failed_one_ends_in_a_sentence(caplog):
    """A joined cluster without room for the replicas kept `isolab serve` waiting without a word: what
    Serve says of a replica still waiting is logged, a failed one ends the start with Serve's reason."""
    import logging

    import pytest

    from isolab.scaleout import deploy as d

    names = ["isolab-ab-replica-0", "isolab-ab-replica-1"]
    pending = ("Deployment 'engine' has 1 replicas that have taken more than 30s to be scheduled. "
               "Resources required for each replica: {'CPU': 8}, total resources available: {'CPU': 2}.")
    t = [0.0]

    def sleep(s):
        t[0] += s

    serve = _Serve([{names[0]: _app("RUNNING"), names[1]: _app("DEPLOYING", deployment_message=pending)}] * 200
                   + [{n: _app("RUNNING") for n in names}])
    with caplog.at_level(logging.WARNING, logger="isolab.scaleout"):
        d._wait_running(serve, names, say_every_s=30, poll_s=0.25, clock=lambda: t[0], sleep=sleep)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "1 of 2 replica(s) not running yet" in said[0] and "Resources required" in said[0], said

    failed = _Serve([{names[0]: _app("DEPLOY_FAILED", **RAY_FAILED)}])
    with pytest.raises(d.ScaleOutError, match=re.escape(
            "replica 0 failed to start: The deployment failed to start 3 times in a row: ValueError: bad model")):
        d._wait_running(failed, names, clock=lambda: t[0], sleep=sleep)
    with pytest.raises(d.ScaleOutError, match="replica 1's Serve app is gone"):
        d._wait_running(_Serve([{names[0]: _app("RUNNING")}]), names, clock=lambda: t[0], sleep=sleep)


def test_a_joined_cluster_short_of_cpus_or_gpus_is_named_before_the_wait(caplog):
    import logging

    from isolab.scaleout import deploy as d

    with caplog.at_level(logging.WARNING, logger="isolab.scaleout"):
        d._say_if_no_room({"CPU": 16.0, "GPU": 2.0}, 4, 4.0, 0.5)  # room: silent
        assert not caplog.records
        d._say_if_no_room({"CPU": 6.0}, 4, 2.0, 1.0)
    [said] = [r.getMessage() for r in caplog.records]
    assert "4 x 2 CPU = 8 CPU (free: 6)" in said and "4 x 1 GPU = 4 GPU (free: 0)" in said, said


def test_deploy_waits_through_the_speaking_wait_and_a_failed_replica_ends_the_start(monkeypatch):
    """deploy() itself: the apps are started without Serve's silent wait, and the wait that names a
    failed replica's reason ends the start (and removes what started)."""
    import types

    import pytest

    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import ray

    from isolab.config import build_engine_config
    from isolab.scaleout import deploy as d

    calls: dict = {}

    def run_many(targets, **kw):
        calls["run_many"] = kw
        calls["names"] = [t.name for t in targets]
        return [object() for _ in targets]

    serve = types.SimpleNamespace(
        start=lambda **kw: None, run_many=run_many,
        RunTarget=lambda app, name, route_prefix: types.SimpleNamespace(name=name),
        deployment=lambda *a, **kw: types.SimpleNamespace(bind=lambda *a: None),
        status=lambda: types.SimpleNamespace(applications={n: _app("DEPLOY_FAILED", **RAY_FAILED)
                                                           for n in calls["names"]}))
    torn: list[str] = []
    monkeypatch.setattr(d, "require_ray", lambda: serve)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(d, "_teardown", lambda prefix, local: torn.append(prefix))
    with pytest.raises(d.ScaleOutError, match="replica 0 failed to start: .* ValueError: bad model"):
        d.deploy(build_engine_config(), d.ScaleOut(replicas=2, threads_per_replica=1, ray_address="auto"), 8)
    assert calls["run_many"] == {"wait_for_applications_running": False} and len(torn) == 1
