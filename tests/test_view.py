"""``retool view``: loading, mask checks, escaping, and the page in a real headless Chromium."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from retool import cli
from retool.report import ReportInputError, read_jsonl
from retool.report import view
from retool.serialize import trajectory_from_jsonable

pytestmark = pytest.mark.timeout(120)  # the viewer tests start a headless browser

FIXTURES = Path(__file__).parent / "fixtures" / "report"
TOKENIZER = FIXTURES / "tokenizer"
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"
IN_CI = os.environ.get("CI", "").lower() == "true"


def run_cli(argv: list[str]) -> int:
    """``retool …`` in-process, through retool's real command line."""
    return cli.main(argv)


def _run_trajectories() -> list:
    rows = read_jsonl(FIXTURES / "run" / "trajectories" / "step_000001.jsonl.gz")
    return [trajectory_from_jsonable(r["trajectory"]) for r in rows]


# ---------------------------------------------------------------- loading and checks


def test_load_items_from_a_run_folder_and_an_eval_file(capsys):
    items, sources = view.load_items([FIXTURES / "run", FIXTURES / "eval" / "base.jsonl"])
    assert len(items) == 16 + 16
    assert [Path(s).name for s in sources] == ["step_000001.jsonl.gz", "step_000002.jsonl.gz", "base.jsonl"]
    assert "metrics.jsonl" in capsys.readouterr().err  # skipped, and said so
    assert items[0].source == "step 1 · group 0 · #0" and items[0].advantage is not None
    assert items[16].source == "base · retool · sample 1" and items[16].advantage is None
    assert items[16].question.startswith("Find the remainder") and items[16].gold == "2"


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ReportInputError, match="neither a trajectory log nor an eval results file"):
        view.load_items([FIXTURES / "run" / "metrics.jsonl"])
    with pytest.raises(ReportInputError, match="no such file"):
        view.load_items([tmp_path / "missing.jsonl"])
    rows = read_jsonl(FIXTURES / "run" / "trajectories" / "step_000001.jsonl.gz")
    rows[2]["trajectory"]["mask_T"].pop()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ReportInputError, match=r"bad.jsonl:3: not a valid trajectory.*lengths differ"):
        view.load_items([bad])


def test_fixture_trajectories_have_no_mask_warnings():
    assert all(view.mask_warnings(t) == [] for t in _run_trajectories())


def test_mask_warnings_catch_masking_bugs():
    t = _run_trajectories()[1]  # has a tool call: prompt, policy and interpreter tokens
    mask = list(t.mask_T)
    first_tool = next(i for i in range(t.prompt_len, len(mask)) if mask[i] == 0)
    leaked = dataclasses.replace(t, mask_T=tuple(mask[:first_tool] + [1] * (len(mask) - first_tool)))
    assert any("mask marks" in w for w in view.mask_warnings(leaked))  # interpreter tokens trained
    in_prompt = dataclasses.replace(t, mask_T=(1,) + t.mask_T[1:])
    assert any("inside the prompt" in w for w in view.mask_warnings(in_prompt))
    odd = dataclasses.replace(t, mask_T=t.mask_T[:-1] + (2,))
    assert any("other than 0/1" in w for w in view.mask_warnings(odd))
    stray = dataclasses.replace(t, logprobs_T=(-1.0,) + t.logprobs_T[1:])
    assert view.mask_warnings(stray) == ["1 masked token(s) carry a non-zero logprob"]


def test_token_texts_decode_with_the_tokenizer_and_flag_unknown_ids():
    tokenizer = view.load_tokenizer(str(TOKENIZER))
    texts = view.token_texts(tokenizer, {0, 1, 10**6})
    assert texts == {"0": "<|im_start|>", "1": "<|im_end|>", "1000000": None}
    with pytest.raises(ReportInputError, match="cannot load tokenizer"):
        view.load_tokenizer(str(FIXTURES / "eval"))


# ---------------------------------------------------------------- the page


def test_page_is_self_contained_and_hides_hostile_text(tmp_path, capsys):
    out = tmp_path / "view.html"
    assert run_cli(["view", str(FIXTURES / "run"), "-o", str(out), "--title", "<b>run</b>"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "&lt;b&gt;run&lt;/b&gt;" in page and "<b>run</b>" not in page
    assert "__pwned" not in page            # model text only exists inside the encoded payload
    assert "http://" not in page and "https://" not in page
    assert "default-src 'none'" in page     # the page may not fetch anything
    assert page.count("<script") == 2       # the data block and our own code


def test_default_output_paths_and_limit(tmp_path, capsys):
    assert view.default_out(Path("a/step_000001.jsonl.gz")) == Path("a/step_000001.html")
    assert view.default_out(Path("b/base.jsonl")) == Path("b/base.html")
    assert view.default_out(FIXTURES / "run") == FIXTURES / "run" / "view.html"
    source = tmp_path / "base.jsonl"
    shutil.copy(FIXTURES / "eval" / "base.jsonl", source)
    assert run_cli(["view", str(source), "--limit", "3"]) == 0
    assert (tmp_path / "base.html").is_file()
    assert run_cli(["view", str(source), "--limit", "0"]) == 2
    assert run_cli(["view", str(tmp_path / "nothing.jsonl")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_unwritable_output_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    assert run_cli(["view", str(FIXTURES / "run"), "-o", str(blocker / "sub" / "view.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write --output ") and "is a file, not a folder" in err
    assert len(err.strip().splitlines()) == 1 and blocker.read_text() == "keep me"


# ---------------------------------------------------------------- real browser


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of a system Chromium; installs the Debian package once when running as root."""
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        lock = ["-o", "DPkg::Lock::Timeout=300"]
        subprocess.run(["apt-get", *lock, "update", "-q"], check=True, env=env, capture_output=True)
        subprocess.run(["apt-get", *lock, "install", "-y", "-q", "chromium"], check=True, env=env,
                       capture_output=True)
        path = shutil.which("chromium")
    if path is None:
        if IN_CI:
            pytest.fail("CI=true but Chromium is missing and could not be installed")
        pytest.skip("Chromium is not installed and this is not root: run `apt-get install -y chromium`")
    return path


@pytest.fixture(scope="module")
def browser(chromium):
    """Headless Chromium through playwright's sync API, for this module's tests only.

    The sync API runs an asyncio event loop in this thread for as long as
    ``sync_playwright()`` is open; session scope kept it open after this module, and every
    later ``asyncio.run`` in the same pytest call failed with "cannot be called from a
    running event loop". Module scope closes it when this file's tests end."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if IN_CI:
            pytest.fail("CI=true but the playwright package is missing (pip install -e .[test])")
        pytest.skip("the playwright package is not installed (pip install -e .[test])")
    with sync_playwright() as pw:
        # Never `playwright install`: drive the system Chromium. --no-sandbox: CI runs as root.
        instance = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield instance
        instance.close()


def _open(browser, html_path: Path):
    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
    page.goto(html_path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=15_000)
    return page, requests, errors


def _expand(card) -> None:
    """Open a trajectory card and wait for its body (rendered on the async toggle event)."""
    card.locator("summary").click()
    card.locator(".body .tokens").wait_for()


def _shows(page, expected: int) -> int:
    """Wait until the visible-count element says ``expected`` (fails after 5 s otherwise)."""
    from playwright.sync_api import expect

    expect(page.locator("#visible-count")).to_have_attribute("data-count", str(expected), timeout=5_000)
    return expected


def test_view_in_headless_chromium(browser, tmp_path):
    out = tmp_path / "view.html"
    inputs = [FIXTURES / "run" / "trajectories", FIXTURES / "eval" / "base.jsonl"]
    assert view.write_view(inputs, out, tokenizer_name=str(TOKENIZER)) == out
    items, _ = view.load_items(inputs)
    page, requests, errors = _open(browser, out)

    total = len(items)
    correct = sum(i.trajectory.grade.correct for i in items)
    used_tool = sum(i.trajectory.num_code_calls > 0 for i in items)
    assert _shows(page, total) == page.locator("details.traj").count()
    assert 0 < correct < total and 0 < used_tool < total
    page.click("#filter-correct-yes")
    _shows(page, correct)
    assert page.locator("details.traj:visible").count() == correct
    page.click("#filter-correct-no")
    _shows(page, total - correct)
    page.click("#filter-correct-all")
    page.click("#filter-tool-no")
    _shows(page, total - used_tool)
    page.click("#filter-tool-all")
    _shows(page, total)

    # The hostile trajectory (step 1, group 0, #1): tokens coloured by mask, text inert.
    index = next(n for n, i in enumerate(items) if i.source == "step 1 · group 0 · #1")
    card = page.locator("details.traj").nth(index)
    _expand(card)
    trajectory = items[index].trajectory
    assert card.locator(".tok.pol").count() == sum(trajectory.mask_T)
    assert card.locator(".tok.pol.neg").count() == sum(trajectory.mask_T)  # advantage < 0
    assert card.locator(".tok.msk").count() == len(trajectory.mask_T) - sum(trajectory.mask_T)
    assert "<script>window.__pwned = 1</script>" in card.locator("pre.output").first.text_content()
    assert page.evaluate("window.__pwned") is None and errors == []
    assert page.locator("main script, main img").count() == 0
    title = card.locator(".tok.pol").first.get_attribute("title")
    assert "logprob" in title and "advantage -1.000" in title

    # An eval sample (no advantage) from the same page.
    eval_card = page.locator("details.traj").nth(16)
    _expand(eval_card)
    assert eval_card.locator(".tok.pol.nil").count() == sum(items[16].trajectory.mask_T)
    assert "Find the remainder" in eval_card.locator(".body pre.text").first.text_content()

    assert all(url.startswith("file://") for url in requests), requests  # nothing from the network
    ARTIFACTS.mkdir(exist_ok=True)
    page.evaluate("el => window.scrollTo(0, el.getBoundingClientRect().top + window.scrollY"
                  " - document.querySelector('header').offsetHeight - 8)", card.element_handle())
    page.screenshot(path=str(ARTIFACTS / "view.png"))
    page.close()


def test_view_without_tokenizer_shows_ids_and_flags_a_broken_mask(browser, tmp_path):
    rows = read_jsonl(FIXTURES / "eval" / "step-20.jsonl")
    rows[2]["samples"][1]["mask_T"][0] = 1  # a policy token inside the prompt: a masking bug
    source = tmp_path / "step-20.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = view.write_view([source], tmp_path / "ids.html")
    items, _ = view.load_items([source])
    page, _, errors = _open(browser, out)
    page.click("#filter-warn-yes")
    _shows(page, 1)
    broken = page.locator("details.traj:visible")
    _expand(broken)
    assert "policy token(s) inside the prompt" in broken.locator(".warnings").text_content()
    page.click("#filter-warn-all")
    _shows(page, len(items))
    card = page.locator("details.traj").first
    _expand(card)
    first_id = items[0].trajectory.tokens_T[0]
    assert card.locator(".tok").first.text_content() == f"{first_id} "
    assert card.locator(".tok.pol").count() == sum(items[0].trajectory.mask_T) and errors == []
    page.close()


def test_view_of_a_regraded_file_shows_both_verdicts(browser, tmp_path, capsys):
    from retool.cli import main

    rows = read_jsonl(FIXTURES / "eval" / "base.jsonl")
    source = tmp_path / "base.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    golds = tmp_path / "golds.jsonl"  # every gold changed to 70: the correct sample flips, any "70" flips back
    golds.write_text("".join(json.dumps({"id": r["problem_id"], "question": "q", "answer": "70"}) + "\n"
                             for r in rows if r["type"] == "problem"))
    assert main(["regrade", str(source), "--data", str(golds)]) == 0
    flips = int(capsys.readouterr().out.split("verdict flips: ")[1].split()[0])
    out = tmp_path / "view.html"
    view.write_view([tmp_path / "base.regraded.jsonl"], out)
    page, requests, errors = _open(browser, out)
    assert f"regraded: {flips} verdict(s) changed" in page.locator("#stats").text_content()
    assert page.locator("details.traj summary .badge", has_text="regraded: was").count() == flips > 0
    card = page.locator("details.traj").first
    _expand(card)
    assert "before regrade: answer" in card.locator(".body").text_content()
    assert errors == [] and all(url.startswith("file://") for url in requests)
    page.close()
