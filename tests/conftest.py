"""Session hooks: the shared vLLM server (``tests/vllm_shared.py``) starts loading when
collection ends, if a selected test uses the ``vllm_server`` fixture and no external
server is given (``RETOOL_TEST_VLLM_URL``); it is stopped when the session ends.

Under ``pytest -n N`` (pytest-xdist, whole files per worker) every worker collects every
test, so a worker starts the server only when it begins a file that needs it: the other
workers never load one."""

import os

_files_needing_server: set[str] = set()


def pytest_collection_finish(session):
    if os.environ.get("RETOOL_TEST_VLLM_URL"):
        return
    needing = {item.nodeid.split("::")[0] for item in session.items
               if "vllm_server" in getattr(item, "fixturenames", ())}
    if not needing:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _files_needing_server.update(needing)
        return
    from tests import vllm_shared

    vllm_shared.start_early()


def pytest_runtest_setup(item):
    if item.nodeid.split("::")[0] in _files_needing_server:
        _files_needing_server.clear()
        from tests import vllm_shared

        vllm_shared.start_early()


def pytest_sessionfinish(session):
    import sys

    shared = sys.modules.get("tests.vllm_shared")
    if shared is not None:
        shared.stop()
