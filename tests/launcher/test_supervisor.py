"""Child processes: restart with backoff, shutdown escalation, no orphans after a launcher dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from flotilla.services.launcher.processes import ChildSpec
from flotilla.services.launcher.supervisor import RestartPolicy, Supervisor
from tests.launcher.helpers import gone, wait_until

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]
STUBBORN = [sys.executable, "-c", textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print('ready', flush=True)
    time.sleep(120)
""")]
FAST = RestartPolicy(min_backoff_s=0.1, max_backoff_s=0.4, stable_after_s=60)


def test_a_dead_child_is_restarted_with_backoff(tmp_path) -> None:
    changes = []
    sup = Supervisor([ChildSpec("engine", SLEEPER), ChildSpec("other", SLEEPER)], tmp_path, FAST,
                     on_change=lambda: changes.append(dict(sup.pids())))
    sup.start()
    try:
        first = sup.pids()["engine"]
        other = sup.pids()["other"]
        os.kill(first, signal.SIGKILL)
        dead = [first]

        def restarted() -> bool:
            sup.poll()
            return sup.pids()["engine"] not in dead and sup.children["engine"].running

        assert wait_until(restarted, timeout=10)
        assert sup.restarts() == {"engine": 1, "other": 0}
        assert sup.pids()["other"] == other  # the others are left alone
        assert changes[-1]["engine"] == sup.pids()["engine"]  # state kept in step
        # A second quick death waits longer (the backoff doubled).
        second = sup.pids()["engine"]
        dead.append(second)
        os.kill(second, signal.SIGKILL)
        assert wait_until(lambda: gone(second))
        t0 = time.monotonic()
        sup.poll()
        restart_at = sup._slots["engine"].restart_at
        assert restart_at is not None and restart_at - t0 >= 2 * FAST.min_backoff_s
        assert wait_until(restarted)
        assert sup.restarts()["engine"] == 2
        assert (tmp_path / "engine.log").read_text().count(" starting ") == 3  # one log, appended
    finally:
        sup.stop(grace_s=2)
    assert all(gone(pid) for pid in sup.pids().values())


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path) -> None:
    sup = Supervisor([ChildSpec("stubborn", STUBBORN)], tmp_path, FAST)
    sup.start()
    assert wait_until(lambda: "ready" in sup.children["stubborn"].tail())
    sup.stop(grace_s=0.5)
    assert gone(sup.pids()["stubborn"])


def test_no_restart_after_stop(tmp_path) -> None:
    sup = Supervisor([ChildSpec("a", SLEEPER)], tmp_path, FAST)
    sup.start()
    sup.stop(grace_s=2)
    sup.poll()
    assert sup.restarts() == {"a": 0} and not sup.children["a"].running


def test_children_die_with_a_sigkilled_launcher(tmp_path) -> None:
    """PR_SET_PDEATHSIG: a launcher killed with SIGKILL (no cleanup code runs) leaves no child."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from flotilla.services.launcher.processes import ChildSpec
        from flotilla.services.launcher.supervisor import Supervisor
        sup = Supervisor([ChildSpec("a", {SLEEPER!r}), ChildSpec("b", {STUBBORN!r})],
                         Path({str(tmp_path)!r}))
        sup.start()
        print(" ".join(str(p) for p in sup.pids().values()), flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        launcher.kill()
        launcher.wait()
        # "b" ignores SIGTERM, as a wedged service might: the death signal is SIGKILL.
        assert wait_until(lambda: all(gone(p) for p in pids), timeout=10)
    finally:
        launcher.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
