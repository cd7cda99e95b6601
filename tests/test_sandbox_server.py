"""The SandboxFusion-compatible server, its client and ``retool sandbox``.

The first half checks the request/response mapping as pure functions, validating our
answers with the official ``sandbox_fusion`` client's own pydantic models. The second
half starts the real server (real executor, no mocks) on a free loopback port and talks
to it with the official client, verl's exact payload, raw HTTP and our client.
All network traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import sandbox_fusion
from sandbox_fusion import RunCodeRequest as OfficialRequest
from sandbox_fusion import RunCodeResponse as OfficialResponse
from sandbox_fusion import RunStatus, SummaryMapping, summary_run_code_result

from retool.sandbox.client import (
    SandboxClient,
    SandboxRequestError,
    ServerUnavailableError,
    build_request,
    from_response,
)
from retool.sandbox.server import (
    DEFAULT_WORKERS,
    BackgroundServer,
    RequestError,
    ServerConfig,
    parse_request,
    to_response,
    to_run_args,
)
from retool.types import ExecStatus, ExecutionResult
from tests.snippets import FAST_IO_TEMPLATE

pytestmark = pytest.mark.timeout(120)  # these tests start sandbox servers

REPO = Path(__file__).resolve().parents[1]
SUMMARY = SummaryMapping(Success="ok", Failed="failed", RunFailed="run_failed", RunTimeout="run_timeout")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _body(**fields) -> bytes:
    return json.dumps({"code": "print(1)", "language": "python", **fields}).encode()


def _refusal(body: bytes, config: ServerConfig = ServerConfig()) -> RequestError:
    with pytest.raises(RequestError) as info:
        to_run_args(parse_request(body), config)
    return info.value


# ---------------------------------------------------------------- request mapping


def test_full_official_request_maps_to_run_args():
    official = OfficialRequest(
        code="print(open('in.txt').read())",
        language="python",
        run_timeout=3,
        stdin="hi",
        files={"in.txt": _b64(b"data"), "skipped.txt": None, "sub/dir/x.bin": _b64(b"\x00\xff")},
        fetch_files=["out.txt", "./sub/y.txt"],
    )
    body = json.dumps({**official.dict(), "memory_limit_MB": 512}).encode()
    args = to_run_args(parse_request(body), ServerConfig())
    assert args.code == official.code and args.auto_print is False  # runs as a script (see below)
    assert (args.timeout_s, args.memory_mb, args.stdin) == (3.0, 512, "hi")
    assert args.files == {"in.txt": b"data", "sub/dir/x.bin": b"\x00\xff"}
    assert args.fetch_files == ("out.txt", "./sub/y.txt")  # kept as given: answers use these names


def test_defaults_defer_to_the_server():
    args = to_run_args(parse_request(_body(memory_limit_MB=-1)), ServerConfig())
    assert args.timeout_s is None and args.memory_mb is None and args.stdin is None
    assert args.files == {} and args.fetch_files == ()


def test_bad_json_is_400_with_a_clear_message():
    with pytest.raises(RequestError) as info:
        parse_request(b'{"code": "print(1)", ')
    assert info.value.http_status == 400 and "not valid JSON" in info.value.detail
    with pytest.raises(RequestError) as info:
        parse_request(b"\xff\xfe")
    assert info.value.http_status == 400


@pytest.mark.parametrize(
    "body, loc",
    [
        (b"[1, 2]", None),
        (json.dumps({"language": "python"}).encode(), ["body", "code"]),
        (json.dumps({"code": 5, "language": "python"}).encode(), ["body", "code"]),
        (_body(run_timeout=0), ["body", "run_timeout"]),
        (_body(run_timeout="soon"), ["body", "run_timeout"]),
        (_body(files=["a.txt"]), ["body", "files"]),
    ],
)
def test_invalid_fields_are_422_naming_the_field(body, loc):
    error = _refusal(body)
    assert error.http_status == 422
    if loc is not None:
        assert [e["loc"][:2] for e in error.detail] == [loc]


@pytest.mark.parametrize("language", ["cpp", "nodejs", "python3", "Python", ""])
def test_unsupported_language_is_422_and_says_what_is_supported(language):
    error = _refusal(_body(language=language))
    assert error.http_status == 422 and error.reason == "unsupported_language"
    (item,) = error.detail
    assert item["loc"] == ["body", "language"]
    assert f"unsupported language {language!r}" in item["msg"] and "'python'" in item["msg"]


def test_limits_over_the_ceiling_are_refused_not_clamped():
    config = ServerConfig(max_timeout_s=60, max_memory_mb=1024)
    assert "ceiling of 60 s" in _refusal(_body(run_timeout=61), config).detail[0]["msg"]
    assert "ceiling of 1024 MB" in _refusal(_body(memory_limit_MB=1025), config).detail[0]["msg"]
    assert to_run_args(parse_request(_body(run_timeout=60, memory_limit_MB=1024)), config).timeout_s == 60


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", "a\\b", "", "nul\x00"])
def test_paths_that_could_escape_the_working_dir_are_refused(path):
    assert _refusal(_body(files={path: _b64(b"x")})).reason == "bad_path"
    assert _refusal(_body(fetch_files=[path])).reason == "bad_path"


@pytest.mark.parametrize("code", ["import sys\nsys.stdout.write('5\\n')", "x = 1  # comment", "print(1", ""])
def test_requests_run_as_scripts_unless_auto_print_is_asked(code):
    """The code is passed on unchanged (it runs as the file main.py); only the flag differs."""
    plain = to_run_args(parse_request(_body(code=code)), ServerConfig())
    shown = to_run_args(parse_request(_body(code=code, auto_print=True)), ServerConfig())
    assert (plain.code, plain.auto_print, shown.code, shown.auto_print) == (code, False, code, True)


def test_bad_base64_is_refused():
    error = _refusal(_body(files={"a.txt": "not base64!"}))
    assert error.reason == "bad_base64" and error.detail[0]["loc"] == ["body", "files", "a.txt"]


# ---------------------------------------------------------------- response mapping

RESULTS = {
    "ok": ExecutionResult(ExecStatus.OK, stdout="4\n", exit_code=0, wall_s=0.01, cpu_s=0.01,
                          observation="4\n", isolation=("rlimits",), files={"out.txt": b"\x00hi"}),
    "error": ExecutionResult(ExecStatus.ERROR, stderr="Traceback ...\nZeroDivisionError", exit_code=1,
                             observation="ZeroDivisionError"),
    "timeout": ExecutionResult(ExecStatus.TIMEOUT, stdout="partial", signal=9, wall_s=1.0,
                               observation="Execution timed out after 1 s"),
    "memory": ExecutionResult(ExecStatus.MEMORY, stderr="MemoryError", exit_code=1, peak_rss_bytes=1 << 28),
    "killed": ExecutionResult(ExecStatus.MEMORY, signal=9),
    "output_limit": ExecutionResult(ExecStatus.OUTPUT_LIMIT, stdout="x" * 10, signal=9, truncated=True),
    "sandbox_error": ExecutionResult(ExecStatus.SANDBOX_ERROR, stderr="worker died"),
}
EXPECTED = {  # name: (overall status, run_result.status, return_code, official summary)
    "ok": ("Success", "Finished", 0, "ok"),
    "error": ("Failed", "Finished", 1, "run_failed"),
    "timeout": ("Failed", "TimeLimitExceeded", None, "run_timeout"),
    "memory": ("Failed", "Finished", 1, "run_failed"),
    "killed": ("Failed", "Finished", -9, "run_failed"),
    "output_limit": ("Failed", "Finished", -9, "run_failed"),
    "sandbox_error": ("SandboxError", "Error", None, None),
}


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_responses_validate_against_the_official_models(name):
    result = RESULTS[name]
    answer = json.loads(json.dumps(to_response(result, fetch_files=("out.txt", "missing.txt"))))
    official = OfficialResponse(**answer)
    overall, run_status, return_code, summary = EXPECTED[name]
    assert official.status.value == overall
    assert official.run_result.status.value == run_status
    assert official.run_result.return_code == return_code
    assert official.run_result.stdout == result.stdout and official.run_result.stderr == result.stderr
    if summary is not None:
        assert summary_run_code_result(official, SUMMARY) == summary
    else:
        assert "worker died" in official.message
    expected_files = {"out.txt": _b64(b"\x00hi")} if name == "ok" else {}
    assert official.files == expected_files


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_client_recovers_the_exact_result_from_our_response(name):
    result = RESULTS[name]
    answer = json.loads(json.dumps(to_response(result, fetch_files=tuple(result.files))))
    assert from_response(answer) == result


def test_client_reads_a_plain_sandbox_fusion_answer():
    """Answers of the official server carry no ``retool`` object."""
    ok = {"status": "Success", "message": "", "compile_result": None, "executor_pod_name": None, "files": {},
          "run_result": {"status": "Finished", "execution_time": 0.02, "return_code": 0,
                         "stdout": "Hello, world!\n", "stderr": ""}}
    result = from_response(ok)
    assert (result.status, result.stdout, result.exit_code, result.observation) == (
        ExecStatus.OK, "Hello, world!\n", 0, "Hello, world!\n")
    failed = {**ok, "status": "Failed", "run_result": {**ok["run_result"], "return_code": 1, "stderr": "Boom"}}
    assert from_response(failed).status is ExecStatus.ERROR and "Boom" in from_response(failed).observation
    killed = {**ok, "status": "Failed", "run_result": {**ok["run_result"], "return_code": -9}}
    assert (from_response(killed).signal, from_response(killed).exit_code) == (9, None)
    tle = {**ok, "status": "Failed", "run_result": {"status": "TimeLimitExceeded", "execution_time": 2.0}}
    assert from_response(tle, timeout_s=2).observation == "Execution timed out after 2 s"
    broken = {"status": "SandboxError", "message": "runner crashed", "run_result": None}
    assert from_response(broken).status is ExecStatus.SANDBOX_ERROR
    assert from_response(broken).stderr == "runner crashed"


def test_client_requests_validate_against_the_official_model():
    body = build_request("print(1)", timeout_s=2.5, memory_mb=256, stdin="x", files={"a": b"\x01"},
                         fetch_files=["b"])
    official = OfficialRequest(**body)
    assert (official.run_timeout, official.stdin, official.files, official.fetch_files) == (2.5, "x", {"a": "AQ=="}, ["b"])
    assert body["memory_limit_MB"] == 256
    assert "run_timeout" not in build_request("1") and "memory_limit_MB" not in build_request("1")
    assert SandboxClient("http://127.0.0.1:9/run_code/").endpoint == "http://127.0.0.1:9"


# ---------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def server():
    """The real server with the real executor on a free loopback port."""
    from retool.sandbox import SandboxConfig
    from retool.sandbox.server import BackgroundServer

    config = ServerConfig(port=0, max_request_mb=1, max_timeout_s=30,
                          sandbox=SandboxConfig(workers=4, timeout_s=10))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")  # requests must not route loopback via a proxy
        with BackgroundServer(config) as running:
            yield running


def _official(server, **fields) -> OfficialResponse:
    request = OfficialRequest(language="python", **fields)
    return sandbox_fusion.run_code(request, endpoint=server.url, max_attempts=1, client_timeout=60)


def test_official_client_success(server):
    resp = _official(server, code="import sympy\nprint(sympy.factorint(360))", run_timeout=10)
    assert resp.status is RunStatus.Success and resp.message == ""
    assert resp.run_result.stdout == "{2: 3, 3: 2, 5: 1}\n" and resp.run_result.return_code == 0
    assert 0 < resp.run_result.execution_time < 10
    assert summary_run_code_result(resp, SUMMARY) == "ok"


def test_official_client_runtime_error(server):
    resp = _official(server, code="x = 1\nprint('before')\nx / 0")
    assert resp.status is RunStatus.Failed
    assert resp.run_result.status.value == "Finished" and resp.run_result.return_code == 1
    assert resp.run_result.stdout == "before\n" and "ZeroDivisionError" in resp.run_result.stderr
    assert summary_run_code_result(resp, SUMMARY) == "run_failed"


def test_official_client_timeout(server):
    start = time.monotonic()
    resp = _official(server, code="import time\nprint('start', flush=True)\ntime.sleep(60)", run_timeout=1)
    assert time.monotonic() - start < 10
    assert resp.status is RunStatus.Failed and resp.run_result.status.value == "TimeLimitExceeded"
    assert resp.run_result.return_code is None
    assert summary_run_code_result(resp, SUMMARY) == "run_timeout"


def test_official_client_files_round_trip(server):
    blob = bytes(range(256)) * 4
    code = (
        "import pathlib\n"
        "data = pathlib.Path('data/in.bin').read_bytes()\n"
        "pathlib.Path('out.bin').write_bytes(data[::-1])\n"
        "pathlib.Path('sub').mkdir()\n"
        "pathlib.Path('sub/n.txt').write_text(str(len(data)) + input())\n"
    )
    resp = _official(server, code=code, stdin="!", files={"data/in.bin": _b64(blob), "ignored.txt": None},
                     fetch_files=["out.bin", "sub/n.txt", "never-written.txt"])
    assert resp.status is RunStatus.Success, resp.run_result.stderr
    assert sorted(resp.files) == ["out.bin", "sub/n.txt"]
    assert base64.b64decode(resp.files["out.bin"]) == blob[::-1]
    assert base64.b64decode(resp.files["sub/n.txt"]) == b"1024!"


def test_official_client_unsupported_language_fails_clearly(server):
    request = OfficialRequest(code="int main() { return 0; }", language="cpp")
    with pytest.raises(Exception, match=r"422.*unsupported language 'cpp'"):
        sandbox_fusion.run_code(request, endpoint=server.url, max_attempts=1)


def _verl_call(server, code: str, stdin: str) -> dict:
    """Exactly the payload and headers of verl's ``call_sandbox_api``."""
    payload = json.dumps({"compile_timeout": 10, "run_timeout": 10, "code": code, "stdin": stdin,
                          "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []})
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    resp = requests.post(server.url + "/run_code", headers=headers, data=payload, timeout=30)
    resp.raise_for_status()
    return resp.json()


def test_official_client_gets_script_output_not_repl_output(server):
    """A trailing ``sys.stdout.write`` must not also display its return value."""
    resp = _official(server, code="import sys\nsys.stdout.write(input() + '\\n')", stdin="7")
    assert resp.run_result.stdout == "7\n"


def test_verl_payload_is_served_and_classified_as_verl_expects(server):
    ok = _verl_call(server, "a, b = map(int, input().split())\nprint(a + b)", "2 40\n")
    assert ok["status"] == "Success" and ok["run_result"]["status"] == "Finished"
    assert ok["run_result"]["stdout"].rstrip("\n") == "42"
    crash = _verl_call(server, "raise SystemExit(3)", "")
    assert crash["status"] == "Failed" and crash["run_result"]["status"] == "Finished"
    assert crash["run_result"]["return_code"] == 3  # verl: runtime_error


# ---------------------------------------------------------------- verl's own client code

VERL_VERSION = "0.9.1"
VERL_CLIENT = "verl/utils/reward_score/sandbox_fusion/utils.py"
CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def verl(tmp_path_factory, pytestconfig):
    """verl's SandboxFusion client module (``check_correctness``, ``call_sandbox_api``),
    loaded by path from the verl wheel (``pip download --no-deps``; needs only the
    standard library and requests). Skipped when pip cannot fetch it; failed under CI."""
    import importlib.util
    import zipfile

    cache = Path(pytestconfig.cache.mkdir(f"verl-{VERL_VERSION}"))
    target = cache / "sandbox_fusion_utils.py"
    if not target.exists():
        download = tmp_path_factory.mktemp("verl-wheel")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               f"verl=={VERL_VERSION}", "-d", str(download)], capture_output=True, text=True,
                              timeout=300)
        wheels = sorted(download.glob("verl-*.whl"))
        if proc.returncode != 0 or not wheels:
            message = f"could not download verl {VERL_VERSION} with pip: {proc.stderr.strip()[-300:]}"
            pytest.fail(message) if CI else pytest.skip(message)
        with zipfile.ZipFile(wheels[0]) as wheel:
            target.write_bytes(wheel.read(VERL_CLIENT))
    spec = importlib.util.spec_from_file_location("verl_sandbox_fusion_utils", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


A_PLUS_B = "a, b = map(int, input().split())\nprint(a + b)"
FAST_IO_SUM = FAST_IO_TEMPLATE + """a, b = map(int, sys.stdin.readline().split())
print(a + b)
"""
VERL_CASES = {  # name: (generation, in_outs, timeout, expected verdicts)
    "right": (A_PLUS_B, {"inputs": ["2 40\n", "1 1\n"], "outputs": ["42\n", "2"]}, 10, [True, True]),
    "wrong": ("a, b = map(int, input().split())\nprint(a - b)", {"inputs": ["2 40\n"], "outputs": ["42"]}, 10,
              [False]),
    "runtime_error": ("import sys\nx = int(sys.stdin.read())\nprint(1 / x)", {"inputs": ["0"], "outputs": ["0"]},
                      10, [-2]),
    "syntax_error": ("print(1 +)", {"inputs": [""], "outputs": ["1"]}, 10, [-2]),
    "timeout": ("while True:\n    pass", {"inputs": [""], "outputs": [""]}, 1, [-3]),
    "keyboard_interrupt": ("raise KeyboardInterrupt", {"inputs": [""], "outputs": [""]}, 10, [-2]),
    "fn_name": ("class Solution:\n    def add(self, a, b):\n        return a + b",
                {"inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"], "fn_name": "add"}, 10, [True, True]),
    "fast_io_template": (FAST_IO_SUM, {"inputs": ["2 40\n"], "outputs": ["42"]}, 10, [True]),
    "atexit_output": ("import atexit\natexit.register(print, 42)", {"inputs": [""], "outputs": ["42"]}, 10, [True]),
    "uses_file": ("import os\nprint(os.path.basename(__file__), open(__file__).read().count('print'))",
                  {"inputs": [""], "outputs": ["main.py 2"]}, 10, [True]),
}


@pytest.mark.parametrize("name", sorted(VERL_CASES))
def test_verl_check_correctness_verdicts(verl, server, name):
    generation, in_outs, timeout, expected = VERL_CASES[name]
    verdicts, metadata = verl.check_correctness(server.url + "/run_code", in_outs, generation, timeout=timeout)
    assert verdicts == expected, metadata


def test_verl_default_load_gets_no_client_side_failures(verl):
    """64 requests at once (verl's default concurrency), each running to its timeout: with
    the default pool every one is answered within verl's own wait (compile + run + 10 s);
    with 8 workers the queue takes 8 rounds and 15 of 64 come back as client-side failures."""
    import concurrent.futures

    config = ServerConfig(port=0, sandbox=None)
    assert config.sandbox_config().workers == DEFAULT_WORKERS == 64
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        with BackgroundServer(config) as running:
            def call(i: int):
                code = "import time\ntime.sleep(60)" if i else "print(0)"  # all but one run to the timeout
                return verl.call_sandbox_api(running.url + "/run_code", code, "", compile_timeout=2,
                                             run_timeout=2, memory_limit_mb=1024)

            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                answers = list(pool.map(call, range(64)))
            elapsed = time.monotonic() - start
    errors = [error for _, error in answers if error]
    assert errors == [] and elapsed < 14, (errors[:3], elapsed)  # verl waits 2 + 2 + 10 s
    statuses = [answer["run_result"]["status"] for answer, _ in answers]
    assert statuses == ["Finished"] + ["TimeLimitExceeded"] * 63


def test_issue_cases_through_the_official_client(server):
    """The 'like python file.py' cases of issue 15 as a SandboxFusion client sees them."""
    syntax = _official(server, code="x = (1,\n")
    assert syntax.run_result.return_code == 1 and syntax.run_result.stderr.startswith('  File "')
    assert "ast.py" not in syntax.run_result.stderr and "retool" not in syntax.run_result.stderr
    interrupted = _official(server, code="raise KeyboardInterrupt")
    assert interrupted.run_result.return_code == -2
    big = requests.post(server.url + "/run_code", json={"code": "x = bytearray(400 << 20)\nprint(len(x) >> 20)",
                                                         "language": "python", "memory_limit_MB": 512,
                                                         "run_timeout": 20}, timeout=60).json()
    assert big["run_result"]["stdout"] == "400\n" and big["retool"]["memory_baseline_bytes"] > 0
    streams = _official(server, code="import sys\nprint(sys.stdin.mode, sys.stdout.mode, sys.argv, __file__)")
    assert streams.run_result.stdout == "r w ['main.py'] /sandbox/work/main.py\n"


def test_http_refusals_are_clear_and_counted(server):
    bad = requests.post(server.url + "/run_code", data=b'{"code": ', timeout=10)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["detail"]
    missing = requests.post(server.url + "/run_code", json={"language": "python"}, timeout=10)
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "code"]
    huge = requests.post(server.url + "/run_code", json={"code": "#" * (2 << 20), "language": "python"}, timeout=10)
    assert huge.status_code == 413 and "too large" in huge.json()["detail"]
    assert requests.get(server.url + "/v1/ping", timeout=10).json() == "pong"
    metrics = requests.get(server.url + "/metrics", timeout=10).json()
    for reason in ("bad_json", "invalid", "too_large"):
        assert metrics[f"server/rejected_{reason}"] >= 1


def test_our_client_round_trips_files_stdin_and_exact_statuses(server):
    client = SandboxClient(server.url)
    result = client.run_sync("import sys\nd = open('in.txt').read()\nopen('out.txt', 'w').write(d + sys.stdin.read())",
                             stdin=" world", files={"in.txt": b"hello"}, fetch_files=("out.txt",))
    assert result.ok and result.files == {"out.txt": b"hello world"}
    shown = client.run_sync("x = 6\nx * 7")  # our client keeps the local sandbox's auto-print
    assert (shown.stdout, shown.observation) == ("42\n", "42\n")
    assert SandboxClient(server.url, auto_print=False).run_sync("x = 6\nx * 7").stdout == ""
    memory = client.run_sync("x = bytearray(4 * 1024**3)", memory_mb=256)
    assert memory.status is ExecStatus.MEMORY
    timeout = client.run_sync("while True: pass", timeout_s=0.5)
    assert timeout.status is ExecStatus.TIMEOUT and "timed out" in timeout.observation
    with pytest.raises(SandboxRequestError, match="ceiling of 30 s"):
        client.run_sync("1", timeout_s=31)


def test_sixteen_parallel_requests_share_the_pool(server):
    async def burst():
        async with SandboxClient(server.url) as client:
            start = time.monotonic()
            results = await asyncio.gather(
                *(client.run(f"import time\ntime.sleep(0.5)\nprint({i})") for i in range(16))
            )
            return results, time.monotonic() - start

    results, elapsed = asyncio.run(burst())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]
    assert all(r.ok for r in results)
    assert elapsed < 0.6 * 16 * 0.5, f"16 x 0.5 s runs on 4 workers took {elapsed:.1f} s"


def test_unreachable_server_raises_after_retries():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SandboxClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01)
    with pytest.raises(ServerUnavailableError, match="failed 2 times"):
        client.run_sync("print(1)")


# ---------------------------------------------------------------- the CLI


def _cli(*argv: str) -> int:
    """``retool ARGV`` through retool's own parser."""
    from retool.cli import main

    return main(list(argv))


@pytest.mark.parametrize("command", [["sandbox", "run", "-", "--timeout"], ["sandbox", "serve", "--timeout"],
                                     ["sandbox", "serve", "--max-timeout"]])
@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "3601"])
def test_cli_refuses_unbounded_timeouts_in_one_line(command, value, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(*command, value)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2
    assert error.endswith(f"argument {command[-1]}: must be a number of seconds > 0 and <= 3600 "
                          f"(the sandbox's maximum), got '{value}'")


@pytest.mark.parametrize("value", ["inf", "0", "nan", "-1"])
def test_train_and_eval_refuse_unbounded_sandbox_timeouts(value, tmp_path, capsys):
    for command in (["train", "--run-dir", str(tmp_path / "run")], ["eval", "--output", str(tmp_path / "e.jsonl")]):
        code = _cli(*command, "--sandbox-timeout-s", value)
        assert code == 2 and "sandbox_timeout_s must be a number of seconds > 0 and <= 3600" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_train_and_eval_refuse_a_negative_demotion_threshold(value, tmp_path, capsys):
    for command in (["train", "--run-dir", str(tmp_path / "run")], ["eval", "--output", str(tmp_path / "e.jsonl")]):
        code = _cli(*command, "--sandbox-demote-after-s", value)
        assert code == 2 and "sandbox_demote_after_s must be >= 0 seconds (0: never)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_demotion_is_off_by_default_and_on_in_the_service_presets():
    """Off where the sampler may share the CPU (a demoted call would get almost none);
    on, with 32 workers, where calls at the reference run's timeout rate would otherwise
    hold the workers and the cores from the short ones."""
    from retool.config import load_toml, make_config
    from retool.sandbox import SandboxConfig
    from retool.train import TrainConfig

    assert make_config(TrainConfig).sandbox_config().demote_after_s is None
    assert SandboxConfig().demote_after_s is None
    repo = Path(__file__).resolve().parents[1]
    for name, (workers, demote) in {"qwen35-4b-tinker": (32, 1.0), "qwen35-4b-pytrio": (32, 1.0),
                                    "qwen35-4b-vllm": (32, 1.0), "qwen35-4b-local": (8, None),
                                    "cpu-smollm2": (4, None)}.items():
        cfg = make_config(TrainConfig, **load_toml(TrainConfig, repo / "configs" / f"{name}.toml"))
        assert (cfg.sandbox_config().workers, cfg.sandbox_config().demote_after_s) == (workers, demote), name


def test_cli_strict_flags_are_wired():
    from retool.cli import parse_args

    assert parse_args(["sandbox", "serve", "--sandbox-strict"]).strict is True
    assert parse_args(["sandbox", "serve"]).workers == DEFAULT_WORKERS
    from retool.config import config_from_args
    from retool.train import TrainConfig

    cfg = config_from_args(TrainConfig, parse_args(["train", "--sandbox-strict"]))
    assert cfg.sandbox_config().strict is True


def test_cli_run_is_python_file_unless_auto_print(tmp_path, capsys):
    snippet = tmp_path / "snippet.py"
    snippet.write_text("x = 6\nx * 7\n")
    assert _cli("sandbox", "run", str(snippet)) == 0
    assert json.loads(capsys.readouterr().out)["stdout"] == ""
    assert _cli("sandbox", "run", str(snippet), "--auto-print") == 0
    assert json.loads(capsys.readouterr().out)["stdout"] == "42\n"


def test_cli_run_prints_the_result_as_json(tmp_path, capsys):
    snippet = tmp_path / "snippet.py"
    snippet.write_text("print(sum(range(10)))\n")
    assert _cli("sandbox", "run", str(snippet), "--timeout", "5") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "ok" and record["stdout"] == "45\n"
    snippet.write_text("1 / 0\n")
    assert _cli("sandbox", "run", str(snippet)) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "error"


def test_cli_run_against_the_server(server, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("21")
    snippet = tmp_path / "snippet.py"
    snippet.write_text("open('out.txt', 'w').write(str(2 * int(open('data.txt').read())))\n")
    code = _cli("sandbox", "run", str(snippet), "--endpoint", server.url,
                "--put", f"{tmp_path / 'in.txt'}=data.txt", "--fetch", "out.txt")
    record = json.loads(capsys.readouterr().out)
    assert code == 0, record
    assert base64.b64decode(record["files"]["out.txt"]) == b"42"


def test_cli_serve_starts_answers_and_shuts_down_on_sigterm(tmp_path):
    import select

    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_PROXY": "127.0.0.1,localhost"}
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "retool", "sandbox", "serve", "--port", "0", "--workers", "1"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
        )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        line = proc.stdout.readline() if ready else ""
        assert "listening on http://127.0.0.1:" in line, log_path.read_text()
        url = line.split("listening on ")[1].split()[0]
        resp = requests.post(url + "/run_code", json={"code": "print('hi')", "language": "python"}, timeout=30)
        assert resp.json()["run_result"]["stdout"] == "hi\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "shutting down" in out
    assert "sandbox closed" in log_path.read_text()


# ---------------------------------------------------------------- stateful sessions


@pytest.fixture(scope="module")
def session_server():
    """A server with a small session bound and a short idle timeout."""
    from retool.sandbox import SandboxConfig

    config = ServerConfig(port=0, max_sessions=2, session_idle_s=1.0,
                          sandbox=SandboxConfig(workers=2, timeout_s=5, preload=("math",)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        with BackgroundServer(config) as running:
            yield running


def _run_in(server, session_id: str, code: str, **fields) -> dict:
    return requests.post(server.url + "/run_code", json={"code": code, "language": "python", "auto_print": True,
                                                         "session_id": session_id, **fields}, timeout=30).json()


def test_server_sessions_keep_state_expire_and_are_bounded(session_server):
    url = session_server.url
    first = requests.post(url + "/sessions", timeout=10).json()
    assert first["idle_timeout_s"] == 1.0
    assert _run_in(session_server, first["session_id"], "x = 41")["status"] == "Success"
    assert _run_in(session_server, first["session_id"], "x + 1")["run_result"]["stdout"] == "42\n"
    plain = requests.post(url + "/run_code", json={"code": "print(x)", "language": "python"}, timeout=30).json()
    assert "NameError" in plain["run_result"]["stderr"]  # without session_id: stateless as before

    second = requests.post(url + "/sessions", timeout=10).json()["session_id"]
    third = requests.post(url + "/sessions", timeout=10)
    assert third.status_code == 429 and "too many open sessions (this server's limit is 2)" in third.json()["detail"]
    refused = requests.post(url + "/run_code", json={"code": "1", "language": "python", "session_id": second,
                                                     "stdin": "x"}, timeout=10)
    assert refused.status_code == 422 and "no stdin, files or fetch_files" in refused.text
    assert requests.delete(f"{url}/sessions/{second}", timeout=10).json() == {"closed": True}
    assert requests.delete(f"{url}/sessions/{second}", timeout=10).status_code == 404

    timeout = _run_in(session_server, first["session_id"], "while True: pass", run_timeout=0.5)
    assert timeout["run_result"]["status"] == "TimeLimitExceeded"
    lost = _run_in(session_server, first["session_id"], "x")
    assert lost["retool"]["state_lost"] == "timeout" and "NameError" in lost["run_result"]["stderr"]

    time.sleep(2.5)  # idle for longer than session_idle_s: expired
    gone = requests.post(url + "/run_code", json={"code": "1", "language": "python",
                                                  "session_id": first["session_id"]}, timeout=10)
    assert gone.status_code == 404 and "no open session" in gone.json()["detail"]
    metrics = requests.get(url + "/metrics", timeout=10).json()
    assert metrics["server/sessions_open"] == 0 and metrics["server/sessions_expired"] >= 1


def test_our_client_runs_a_remote_session(session_server):
    async def main():
        async with SandboxClient(session_server.url) as client:
            async with client.session() as session:
                await session.run("import math\nr = math.isqrt(10**6)")
                return (await session.run("r + 1")).stdout

    assert asyncio.run(main()) == "1001\n"


def test_cli_run_stateful_files_share_one_interpreter(session_server, tmp_path, capsys):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("x = 6\n")
    second.write_text("print(x * 7)\n")
    assert _cli("sandbox", "run", str(first), str(second), "--interpreter", "stateful") == 0
    assert [r["stdout"] for r in json.loads(capsys.readouterr().out)] == ["", "42\n"]
    assert _cli("sandbox", "run", str(first), str(second), "--interpreter", "stateful",
                "--endpoint", session_server.url) == 0
    assert [r["stdout"] for r in json.loads(capsys.readouterr().out)] == ["", "42\n"]
    assert _cli("sandbox", "run", str(first), str(second)) == 1  # stateless: b.py has no x
    assert "NameError" in json.loads(capsys.readouterr().out)[1]["stderr"]
    assert _cli("sandbox", "run", str(first), "--interpreter", "stateful", "--fetch", "x") == 2
    assert "takes no --stdin-file, --put or --fetch" in capsys.readouterr().err


def test_cli_interpreter_flags_are_wired(capsys):
    from retool.cli import parse_args
    from retool.config import config_from_args
    from retool.evaluate import EvalConfig
    from retool.train import TrainConfig

    assert config_from_args(TrainConfig, parse_args(["train"])).interpreter == "stateless"
    assert config_from_args(TrainConfig, parse_args(["train", "--interpreter", "stateful"])).interpreter \
        == "stateful"
    assert config_from_args(EvalConfig, parse_args(["eval", "--interpreter", "stateful"])).interpreter \
        == "stateful"
    with pytest.raises(SystemExit):
        parse_args(["train", "--interpreter", "jupyter"])
    assert "invalid choice: 'jupyter'" in capsys.readouterr().err


def test_a_request_whose_client_gives_up_is_cancelled_and_counted(server):
    import concurrent.futures

    before = requests.get(server.url + "/metrics", timeout=10).json()["server/abandoned"]
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/run_code", json={"code": "import time\ntime.sleep(8)", "language": "python",
                                                      "run_timeout": 10}, timeout=1.0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        metrics = requests.get(server.url + "/metrics", timeout=10).json()
        if metrics["server/abandoned"] == before + 1:
            break
        time.sleep(0.1)
    assert metrics["server/abandoned"] == before + 1
    start = time.monotonic()  # the cancelled run freed its worker: four new runs start at once
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: requests.post(server.url + "/run_code", json={
            "code": "import time\ntime.sleep(3)\nprint('ok')", "language": "python"}, timeout=30).json(), range(4)))
    assert all(o["run_result"]["stdout"] == "ok\n" for o in outs)
    assert time.monotonic() - start < 6.5  # not ~10 s: a fourth run waiting for the abandoned sleep(8)
