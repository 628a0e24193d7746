"""`ddpnb.preload`: modules imported once in the forkserver, checked before any rank is forked from it.

The modules here are written to a temporary directory on PYTHONPATH, which the forkserver (a fresh Python)
sees; each test puts the forkserver back as it found it.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

import ddpnb
from ddpnb.core import hints
from ddpnb.node import forkserver as _forkserver
from tests.conftest import private_runs_dir

MODULES = {
    # a module a rank can tell apart: where it was imported, and a global one run changes
    "ddpnb_test_preloaded": "import os\nIMPORTED_IN = os.getpid()\nMARK = None\nVERSION = 1\n",
    # an installed library slow to import, like torchvision (2.6 s here): the launch that imports it says so
    "site-packages/ddpnb_test_slow": "import os, time\ntime.sleep(0.8)\nIMPORTED_IN = os.getpid()\n",
    # a module of one's own, and an installed one, each importing the slow library in turn
    "ddpnb_test_mine_lazy": "import ddpnb_test_slow\nVALUE = 7\n",
    "site-packages/ddpnb_test_lazy_top": "import ddpnb_test_slow\nVALUE = 3\n",
    "ddpnb_test_threaded": "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n",
    "ddpnb_test_broken": "raise RuntimeError('this module cannot be imported')\n",
    # holds a file open, as a library that initialises CUDA holds /dev/nvidia*, which this machine does not have
    "ddpnb_test_gpu_driver": "import os\nDRIVER = open(os.environ['DDPNB_TEST_FAKE_GPU_FILE'], 'rb')\n",
    # the same name in two places: the kernel finds one (sys.path), the forkserver the other (PYTHONPATH)
    "ddpnb_test_twin": "",
    "kernel-only/ddpnb_test_twin": "",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, source in MODULES.items():
        path = tmp_path / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(source)
    (tmp_path / "fake-nvidia0").write_bytes(b"")
    monkeypatch.setenv("DDPNB_TEST_FAKE_GPU_FILE", str(tmp_path / "fake-nvidia0"))
    monkeypatch.setattr(_forkserver, "GPU_DRIVER_FILES", str(tmp_path / "fake-nvidia"))
    python_path = [str(tmp_path), str(tmp_path / "site-packages"), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, python_path)))
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    with _forkserver.lock:
        _forkserver._preloaded.clear()
        _forkserver._stop()  # the next run starts the usual one
    hints._hinted.clear()
    for name in MODULES:
        sys.modules.pop(name.rpartition("/")[2], None)


def _leave_a_mark(rank):
    import os
    import sys

    preloaded = "ddpnb_test_preloaded" in sys.modules  # before this function imports it
    import ddpnb_test_preloaded as module

    found = {"preloaded": preloaded, "imported before the fork": module.IMPORTED_IN != os.getpid(), "mark": module.MARK}
    module.MARK = "left by an earlier run"
    return found


def test_a_preloaded_module_is_there_when_ranks_start_and_fresh_in_each_run(modules):
    assert ddpnb.run(_leave_a_mark, nprocs=2) == {"preloaded": False, "imported before the fork": False, "mark": None}
    assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]
    assert ddpnb.preload() == ["ddpnb_test_preloaded"]
    for _ in range(2):  # each run gets the module as the forkserver imported it, not as the last run left it
        assert ddpnb.run(_leave_a_mark, nprocs=2) == {"preloaded": True, "imported before the fork": True, "mark": None}


def _version(rank):
    import ddpnb_test_preloaded

    return ddpnb_test_preloaded.VERSION


def test_preloading_a_module_again_picks_up_its_edits(modules):
    ddpnb.preload("ddpnb_test_preloaded")
    assert ddpnb.run(_version, nprocs=1) == 1
    source = modules / "ddpnb_test_preloaded.py"
    source.write_text(source.read_text().replace("VERSION = 1", "VERSION = 22"))  # another size: no stale .pyc
    assert ddpnb.run(_version, nprocs=1) == 1  # preloaded: as it was imported
    assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]
    assert ddpnb.run(_version, nprocs=1) == 22


def test_a_slow_import_is_pointed_out_once_and_preload_removes_it(modules, capsys):
    import ddpnb_test_slow

    def imported_before_the_fork(rank):
        import os

        return ddpnb_test_slow.IMPORTED_IN != os.getpid()  # a notebook global: unpickling imports the module

    assert ddpnb.run(imported_before_the_fork, nprocs=2, view="text") is False
    hint = ddpnb.last_run().hint
    assert "rebuilding the function took rank 0" in hint
    assert "importing 'ddpnb_test_slow'" in hint
    assert "ddpnb.preload('ddpnb_test_slow')" in hint
    assert hint in capsys.readouterr().out  # the text view says it after the summary
    assert ddpnb.run(imported_before_the_fork, nprocs=2) is False
    assert ddpnb.last_run().hint == ""  # said once per kernel
    hints._hinted.clear()
    ddpnb.preload("ddpnb_test_slow")
    assert ddpnb.run(imported_before_the_fork, nprocs=2) is True
    assert ddpnb.last_run().hint == ""  # nothing left to import


def test_a_module_of_ones_own_is_not_suggested_for_preloading(modules):
    (modules / "ddpnb_test_mine.py").write_text("import time\ntime.sleep(0.8)\nVALUE = 7\n")
    import ddpnb_test_mine

    try:
        assert ddpnb.run(lambda: ddpnb_test_mine.VALUE, nprocs=1) == 7
        assert ddpnb.last_run().hint == ""  # edited next to the notebook: preloaded, it would go stale
    finally:
        sys.modules.pop("ddpnb_test_mine", None)


def test_the_hint_names_only_modules_the_functions_pickle_names_not_what_they_import_in_turn(modules):
    """What unpickling the function imported in turn is not the user's to preload: the slow library a module of
    one's own imports, or torch's lazy imports of sympy and mpmath for a `torch.fx` module the function names."""
    import ddpnb_test_lazy_top
    import ddpnb_test_mine_lazy
    from torch.fx.experimental import symbolic_shapes

    def own_module_and_torch_fx(rank, lazy):  # `lazy` in args: a name in the function's code is one it names
        import sys

        return ddpnb_test_mine_lazy.VALUE, symbolic_shapes.__name__, sorted(set(lazy) & set(sys.modules))

    assert ddpnb.run(own_module_and_torch_fx, nprocs=1, args=(["mpmath", "sympy"],)) == (
        7,
        symbolic_shapes.__name__,
        ["mpmath", "sympy"],
    )  # unpickling imported them, and the slow library
    assert ddpnb.last_run().hint == ""  # it took 0.8 s and more, importing only what the pickle never names
    assert ddpnb.run(lambda: ddpnb_test_lazy_top.VALUE, nprocs=1) == 3
    hint = ddpnb.last_run().hint
    assert "ddpnb.preload('ddpnb_test_lazy_top')" in hint and "ddpnb_test_slow" not in hint, hint


@pytest.mark.parametrize(
    "name, reason",
    [
        ("ddpnb_test_threaded", "started 1 thread(s) in the forkserver"),
        ("ddpnb_test_broken", "run `import ddpnb_test_broken` in a cell to see it"),
        ("ddpnb_test_gpu_driver", "importing them initialised CUDA (the GPU driver is open)"),
        ("ddpnb_test_twin", "(a sys.path change in the kernel?): ranks would run the other copy"),
    ],
)
def test_a_module_that_is_unsafe_to_preload_is_refused_and_runs_go_on(modules, monkeypatch, name, reason):
    ddpnb.preload("ddpnb_test_preloaded")
    monkeypatch.syspath_prepend(str(modules / "kernel-only"))  # the kernel's twin is not the forkserver's
    with pytest.raises(ddpnb.PreloadError, match=re.escape(reason)):
        ddpnb.preload(name)
    assert ddpnb.preload() == ["ddpnb_test_preloaded"]  # what was there before stays
    assert ddpnb.run(_leave_a_mark, nprocs=2)["preloaded"] is True


def test_a_name_that_is_no_module_is_refused_before_anything_restarts(modules):
    with pytest.raises(ddpnb.PreloadError, match="no module named 'ddpnb_no_such_module'"):
        ddpnb.preload("ddpnb_no_such_module.sub")
    with pytest.raises(ddpnb.PreloadError, match="takes module names"):
        ddpnb.preload("torch vision")


def test_preload_is_refused_while_a_run_or_another_forkserver_child_is_going(modules):
    import multiprocessing
    import time

    handle = ddpnb.launch(lambda: time.sleep(30), nprocs=1, view="none")
    try:
        with pytest.raises(ddpnb.PreloadError, match="wait for the running run to end"):
            ddpnb.preload("ddpnb_test_preloaded")
    finally:
        handle.stop()
    mine = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(30,))
    mine.start()
    try:
        with pytest.raises(ddpnb.PreloadError, match=f"still running \\(PIDs {mine.pid}"):
            ddpnb.preload("ddpnb_test_preloaded")
    finally:
        mine.kill()
        mine.join()
    assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]


def test_preload_after_a_detached_launch_ends_the_standby_supervisor_and_goes_through(modules, tmp_path_factory):
    """A detached launch forks the next one's supervisor ahead (a standby, with a forkserver of its own); `preload`
    lets it go first, and must not take its forkserver, orphaned to the kernel's for a moment, for a user's pool."""
    import multiprocessing
    import time

    from ddpnb.detached import supervisor

    with private_runs_dir(tmp_path_factory):
        assert ddpnb.launch(lambda: 7, nprocs=1, view="none", detach=True).result(timeout=60) == 7
        deadline = time.monotonic() + 30
        while len(supervisor.standby()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(supervisor.standby()) == 2  # the standby and its forkserver, forked in the background
        mine = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(30,))
        mine.start()
        try:  # refused for `mine` alone, having let the standby go
            with pytest.raises(ddpnb.PreloadError, match=f"still running \\(PIDs {mine.pid}:"):
                ddpnb.preload("ddpnb_test_preloaded")
        finally:
            mine.kill()
            mine.join()
        assert supervisor.standby() == []
        assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]
