"""Session hooks: the shared vLLM server (``tests/vllm_shared.py``) starts loading when
collection ends, if a selected test uses the ``vllm_server`` fixture and no external
server is given (``RETOOL_TEST_VLLM_URL``); it is stopped when the session ends."""

import os


def pytest_collection_finish(session):
    if os.environ.get("RETOOL_TEST_VLLM_URL"):
        return
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        from tests import vllm_shared

        vllm_shared.start_early()


def pytest_sessionfinish(session):
    import sys

    shared = sys.modules.get("tests.vllm_shared")
    if shared is not None:
        shared.stop()
