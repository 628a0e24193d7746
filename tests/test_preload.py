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
from ddpnb import _supervisor

MODULES = {
    # a module a rank can tell apart: where it was imported, and a global one run changes
    "ddpnb_test_preloaded": "import os\nIMPORTED_IN = os.getpid()\nMARK = None\n",
    # slow to import, like torchvision (2.6 s here): the launch that imports it suggests preloading it
    "ddpnb_test_slow": "import time\ntime.sleep(0.8)\nVALUE = 42\n",
    "ddpnb_test_threaded": "import threading, time\n"
                           "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n",
    "ddpnb_test_broken": "raise RuntimeError('this module cannot be imported')\n",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    with _supervisor._forkserver_lock:
        _supervisor._preloaded.clear()
        _supervisor._stop_forkserver()  # the next run starts the usual one
    _supervisor._hinted.clear()
    for name in MODULES:
        sys.modules.pop(name, None)


def _leave_a_mark(rank):
    import os
    import sys

    preloaded = "ddpnb_test_preloaded" in sys.modules  # before this function imports it
    import ddpnb_test_preloaded as module

    found = {"preloaded": preloaded, "imported before the fork": module.IMPORTED_IN != os.getpid(),
             "mark": module.MARK}
    module.MARK = "left by an earlier run"
    return found


def test_a_preloaded_module_is_there_when_ranks_start_and_fresh_in_each_run(modules):
    assert ddpnb.run(_leave_a_mark, nprocs=2) == {"preloaded": False, "imported before the fork": False, "mark": None}
    assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]
    assert ddpnb.preload() == ["ddpnb_test_preloaded"]
    for _ in range(2):  # each run gets the module as the forkserver imported it, not as the last run left it
        assert ddpnb.run(_leave_a_mark, nprocs=2) == {"preloaded": True, "imported before the fork": True,
                                                      "mark": None}


def test_a_slow_import_is_pointed_out_once_and_preload_removes_it(modules, capsys):
    import ddpnb_test_slow

    def uses_the_module(rank):
        return ddpnb_test_slow.VALUE  # a global of the notebook: unpickling the function imports the module

    assert ddpnb.run(uses_the_module, nprocs=2, view="text") == 42
    hint = ddpnb.last_run().hint
    assert "importing 'ddpnb_test_slow' before the function started" in hint
    assert "ddpnb.preload('ddpnb_test_slow')" in hint
    assert hint in capsys.readouterr().out  # the text view says it after the summary
    ddpnb.run(uses_the_module, nprocs=2)
    assert ddpnb.last_run().hint == ""  # said once per kernel
    _supervisor._hinted.clear()
    ddpnb.preload("ddpnb_test_slow")
    ddpnb.run(uses_the_module, nprocs=2)
    assert ddpnb.last_run().hint == ""  # nothing left to import


@pytest.mark.parametrize("name, reason", [
    ("ddpnb_test_threaded", "started 1 thread(s) in the forkserver"),
    ("ddpnb_test_broken", "run `import ddpnb_test_broken` in a cell to see why"),
])
def test_a_module_that_is_unsafe_to_preload_is_refused_and_runs_go_on(modules, name, reason):
    ddpnb.preload("ddpnb_test_preloaded")
    with pytest.raises(ddpnb.PreloadError, match=re.escape(reason)):
        ddpnb.preload(name)
    assert ddpnb.preload() == ["ddpnb_test_preloaded"]  # what was there before stays
    assert ddpnb.run(_leave_a_mark, nprocs=2)["preloaded"] is True


def test_a_name_that_is_no_module_is_refused_before_anything_restarts(modules):
    with pytest.raises(ddpnb.LaunchError, match="no module named 'ddpnb_no_such_module'"):
        ddpnb.preload("ddpnb_no_such_module")
    with pytest.raises(ddpnb.LaunchError, match="takes module names"):
        ddpnb.preload("torch vision")


def test_preload_is_refused_while_a_run_is_going(modules):
    import time

    handle = ddpnb.launch(lambda: time.sleep(30), nprocs=1, view="none")
    try:
        with pytest.raises(ddpnb.PreloadError, match="wait for the running run to end"):
            ddpnb.preload("ddpnb_test_preloaded")
    finally:
        handle.stop()
    assert ddpnb.preload("ddpnb_test_preloaded") == ["ddpnb_test_preloaded"]
