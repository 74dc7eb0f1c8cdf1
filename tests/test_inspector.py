"""The logprob inspector in a real browser: Debian's headless Chromium driven by Playwright,
against a live probity on the tiny model (with an API key, so the page's key path is used).
Numbers on the page are checked against the API and against in-process transformers."""
from __future__ import annotations

import json
import math
import re
import shutil

import httpx
import pytest
import torch

from conftest import API_KEY, TINY_ID

KEY = API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Prices: 5€ and  7¥.\nEmoji 😀 done"  # partial-UTF-8 and whitespace-only tokens


@pytest.fixture
def server(keyed_server):
    return keyed_server


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: `make setup` installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    ctx = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    # a refused API call logs "Failed to load resource"; anything else (a script error, a CSP
    # violation, a missing file) is a defect of the page
    pg.on("console", lambda m: m.type == "error" and "Failed to load resource" not in m.text and errors.append(m.text))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/inspect")
    yield pg
    ctx.close()
    assert not errors, errors


def expect():
    from playwright.sync_api import expect as e

    return e


def use_key(page):
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    expect()(page.locator("#model")).to_have_text(re.compile(f"^model {TINY_ID}"))


def api(server, body: dict) -> dict:
    r = server.post("/v1/completions", {"model": TINY_ID, **body}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def tooltip_numbers(page) -> tuple[float, list[tuple[str, float]], list[str]]:
    tip = page.locator("#tip")
    expect()(tip).to_be_visible()
    lp = float(tip.locator(".v-logprob").inner_text())
    rows = [(r.locator("td.label").inner_text(), float(r.locator("td.lp").inner_text()))
            for r in tip.locator("tbody tr").all()]
    chosen = [r.locator("td.label").inner_text() for r in tip.locator("tbody tr.chosen").all()]
    return lp, rows, chosen


def bin_of(lp: float, scale: str) -> int:
    if scale == "probability":
        edges = [0.9, 0.6, 0.3, 0.1, 0.01]
        return next((i for i, e in enumerate(edges) if math.exp(lp) >= e), 5)
    edges = [1, 2, 4, 6, 9]
    return next((i for i, e in enumerate(edges) if -lp / math.log(2) < e), 5)


def test_page_is_served_without_a_key_but_the_api_still_needs_one(server, page, tmp_path):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert {"/", "/inspect", "/inspector/{name}"} <= set(server.get("/openapi.json", headers=AUTH).json()["paths"])
    assert httpx.get(server.url + "/inspector/inspector.js").headers["content-type"].startswith("text/javascript")
    # the Host guard holds for the page as for the API (DNS rebinding)
    assert httpx.get(server.url + "/", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(server.url + "/inspector/tokens.js", headers={"Host": "evil.example"}).status_code == 400
    assert server.post("/v1/completions", {"model": TINY_ID, "prompt": "x"}).status_code == 401
    for path in ("/inspector/nothing.js", "/inspector/..%2Fv1%2Fmodels", "/inspect/../v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401, path  # only the page's own files are open
    # everything the page needs comes from probity itself: no other origin is contacted
    html = r.text + "".join(httpx.get(server.url + f"/inspector/{f}").text
                            for f in ("inspector.js", "api.js", "tokens.js", "inspector.css"))
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html)

    expect()(page.locator("#model")).to_have_text(re.compile("needs an API key"))
    page.click("#score-form button[type=submit]")
    err = page.locator("#score-error")
    expect()(err).to_be_visible()
    assert err.locator(".code").inner_text() == "invalid_api_key" and "HTTP 401" in err.inner_text()
    page.screenshot(path=tmp_path / "needs-key.png")
    use_key(page)
    page.click("#score-form button[type=submit]")
    expect()(page.locator("#score-result .chip").first).to_be_visible()
    expect()(err).to_be_hidden()


def test_scored_text_has_one_chip_per_token_with_the_apis_numbers(server, page, tmp_path):
    use_key(page)
    page.fill("#score-text", TEXT)
    page.fill("#top-k", "3")
    page.click("#score-form button[type=submit]")
    chips = page.locator("#score-result .chip")
    expect()(chips.first).to_be_visible()
    ref = api(server, {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 3})["choices"][0]["logprobs"]
    tokens, lps, tops = ref["tokens"], ref["token_logprobs"], ref["top_logprobs"]
    assert chips.count() == len(tokens)
    faces = chips.all_inner_texts()
    assert all(f.strip() for f in faces), faces  # whitespace-only and partial tokens stay visible
    partial = tokens.index("")
    assert "partial" in chips.nth(partial).get_attribute("class")
    assert any(re.fullmatch("[␣↵]+", f) for f in faces)

    for i in (1, partial, len(tokens) - 1):
        chips.nth(i).hover()
        lp, rows, chosen = tooltip_numbers(page)
        assert lp == lps[i]
        assert [v for _, v in rows] == sorted(tops[i].values(), reverse=True)
        assert sorted(v for _, v in rows) == sorted(tops[i].values())
        assert len(chosen) == 1 and chosen[0].startswith(json.dumps(tokens[i], ensure_ascii=False)[:-1])
        assert next(v for label, v in rows if "chosen" in label) == lps[i]
    page.screenshot(path=tmp_path / "score-hover.png")

    # keyboard: the strip is one tab stop; arrows move, the tooltip follows the focus
    chips.first.focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    expect()(page.locator("#tip .tip-pos")).to_contain_text("position 2")
    assert tooltip_numbers(page)[0] == lps[2]
    page.keyboard.press("End")
    expect()(page.locator("#tip .tip-pos")).to_contain_text(f"position {len(tokens) - 1}")

    total = sum(lps[1:])  # the page sums left to right too: the same double
    assert float(page.locator("#score-result .totals dd[title]").first.get_attribute("title")) == total
    assert page.locator("#score-result .chart circle").count() == len(tokens) - 1
    for scale in ("probability", "surprisal"):
        page.check(f'input[name="scale"][value="{scale}"]')
        for i in (1, 4, len(tokens) - 1):
            assert f"b{bin_of(lps[i], scale)}" in chips.nth(i).get_attribute("class").split()
    expect()(page.locator("#legend")).to_contain_text("bits")
    page.screenshot(path=tmp_path / "score-surprisal.png", full_page=True)

    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off a phone screen
    chips.nth(3).focus()
    expect()(page.locator("#tip")).to_be_visible()
    page.screenshot(path=tmp_path / "score-phone.png")


def test_generation_streams_chips_that_match_the_api(server, page, tmp_path):
    use_key(page)
    page.focus("#tab-score")
    page.keyboard.press("ArrowRight")  # the tabs are keyboard operable too
    expect()(page.locator("#panel-generate")).to_be_visible()
    assert page.locator("#tab-generate").get_attribute("aria-selected") == "true"
    page.fill("#gen-prompt", "Paris is")
    page.fill("#gen-max", "8")
    page.fill("#gen-temp", "0")
    page.click("#gen-go")
    expect()(page.locator("#gen-status")).to_have_text(re.compile("^finished: length"))
    ref = api(server, {"prompt": "Paris is", "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 5})
    lp = ref["choices"][0]["logprobs"]
    prompt_n = ref["usage"]["prompt_tokens"]
    chips = page.locator("#generate-result .chip")
    assert chips.count() == len(lp["tokens"]) == prompt_n + 8
    assert page.locator("#generate-result .chip.prompt").count() == prompt_n
    assert page.locator("#generate-result .divider").count() == 1
    chips.last.hover()
    got, rows, _ = tooltip_numbers(page)
    assert got == lp["token_logprobs"][-1]
    assert [v for _, v in rows] == sorted(lp["top_logprobs"][-1].values(), reverse=True)
    page.screenshot(path=tmp_path / "generate.png")


def test_a_generated_end_of_sequence_is_a_special_chip(server, page, tmp_path):
    """The contract's EOS entry (labelled with its own text, not part of `text`) is drawn as
    its own chip. The real stream is fetched and ended the way a generated EOS ends it (as
    probity streams it: a chunk with text "" holding the entry, then finish_reason "stop"),
    so the test does not depend on when a random model happens to sample EOS."""
    use_key(page)

    def with_eos(route):
        resp = route.fetch()
        events = [e for e in resp.text().split("\n\n") if e]
        chunks = [json.loads(e[6:]) if e.startswith("data: {") else None for e in events]
        last = max(j for j, c in enumerate(chunks) if c and c["choices"] and c["choices"][0]["finish_reason"])
        offset = sum(len(c["choices"][0]["text"]) for c in chunks[:last] if c and c["choices"])
        eos = {**chunks[last], "choices": [{"index": 0, "text": "", "finish_reason": None, "logprobs": {
            "tokens": ["<|im_end|>"], "token_logprobs": [-0.5], "top_logprobs": [{"<|im_end|>": -0.5, "x": -1.25}],
            "text_offset": [offset]}}]}
        chunks[last]["choices"][0]["finish_reason"] = "stop"
        events[last] = "data: " + json.dumps(chunks[last])
        events.insert(last, "data: " + json.dumps(eos))
        route.fulfill(response=resp, body="\n\n".join(events) + "\n\n")

    page.route("**/v1/completions", with_eos)
    page.click("#tab-generate")
    page.fill("#gen-prompt", "Paris is")
    page.fill("#gen-max", "3")
    page.fill("#gen-seed", "1")  # a fixed generation, so the added EOS is never a second one
    page.click("#gen-go")
    expect()(page.locator("#gen-status")).to_have_text(re.compile("^finished: stop"))
    special = page.locator("#generate-result .chip.special")
    assert special.count() == 1 and special.inner_text() == "<|im_end|>"
    assert "special" in page.locator("#generate-result .chip").last.get_attribute("class")
    special.hover()
    expect()(page.locator("#tip")).to_contain_text("End of sequence")
    page.screenshot(path=tmp_path / "generate-eos.png")


def test_continuations_are_ranked_as_transformers_scores_them(server, page, tiny_hf, tmp_path):
    model, tok = tiny_hf
    use_key(page)
    context, options = "The capital of France is", ["Paris", "Rome", "a big city", "London"]
    ref = {}
    for o in options:  # lm-eval's split: the continuation is what follows the context's tokens
        ctx = tok(context)["input_ids"]
        whole = tok(context + " " + o)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        ref[o] = (sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))), len(whole) - len(ctx))
    page.click("#tab-compare")
    page.fill("#cmp-context", context)
    page.fill("#cmp-options", "\n".join(options))
    page.click("#compare-form button[type=submit]")
    items = page.locator("#compare-result > li")
    expect()(items).to_have_count(len(options))

    def shown():
        return [json.loads(items.nth(i).locator(".cont").inner_text()) for i in range(items.count())]

    assert shown() == sorted(options, key=lambda o: -ref[o][0])
    assert items.locator(".badge:not(.greedy)").count() == 1
    assert items.first.locator(".badge").first.inner_text() == "best"
    for i, o in enumerate(shown()):
        total = float(items.nth(i).locator(".nums span").first.get_attribute("title"))
        assert total == pytest.approx(ref[o][0], abs=1e-4)
        assert items.nth(i).locator(".nums").inner_text().endswith(f"{ref[o][1]} tokens")
    page.select_option("#cmp-rank", "per_char")
    assert shown() == sorted(options, key=lambda o: -ref[o][0] / len(" " + o))
    items.first.locator("summary").click()
    expect()(items.first.locator(".chip").first).to_be_visible()
    assert items.first.locator(".chip").count() == ref[shown()[0]][1]
    page.screenshot(path=tmp_path / "compare.png", full_page=True)


def test_api_errors_are_shown_by_name(server, page, tmp_path):
    use_key(page)
    page.click("#tab-generate")
    page.fill("#gen-temp", "3")
    page.click("#gen-go")
    err = page.locator("#generate-error")
    expect()(err).to_be_visible()
    want = server.post("/v1/completions", {"model": TINY_ID, "prompt": "Once upon a time", "temperature": 3,
                                           "stream": True}, headers=AUTH).json()["error"]
    assert err.locator(".code").inner_text() == want["code"] == "invalid_value"
    assert err.locator(".param").inner_text() == want["param"] == "temperature"
    assert err.locator(".message").inner_text() == want["message"]
    assert "HTTP 400" in err.inner_text()
    page.screenshot(path=tmp_path / "error.png")
    page.click("#tab-compare")
    page.fill("#cmp-options", "Paris\n" + "word " * 400)
    page.click("#compare-form button[type=submit]")
    err = page.locator("#compare-error")
    expect()(err).to_be_visible()
    assert err.locator(".code").inner_text() == "context_length_exceeded"
    assert err.locator(".param").inner_text() == "prompt[1]" and "continuation 2" in err.inner_text()


def test_batch_jobs_tab_shows_each_jobs_progress_as_the_api_reports_it(server, page):
    lines = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": TINY_ID, "prompt": f"line {i}", "max_tokens": 2}}).encode() + b"\n"
                     for i in range(5))
    f = httpx.post(server.url + "/v1/files", headers=AUTH, files={"file": ("in.jsonl", lines)},
                   data={"purpose": "batch"}).json()
    b = httpx.post(server.url + "/v1/batches", headers=AUTH, json={
        "input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
    use_key(page)
    page.click("#tab-batches")
    row = page.locator(f'#batches-body tr[data-batch="{b["id"]}"]')
    expect()(row.locator("td").nth(1)).to_have_text("completed", timeout=30000)
    got = httpx.get(f"{server.url}/v1/batches/{b['id']}", headers=AUTH).json()["request_counts"]
    assert [row.locator("td").nth(i).inner_text() for i in (3, 4, 5)] == [str(got[k]) for k in
                                                                          ("completed", "failed", "total")]
    assert got == {"total": 5, "completed": 5, "failed": 0}
    assert row.locator("progress").get_attribute("value") == "5"


def test_api_docs_page_renders_offline_from_probitys_own_files(browser, server):
    """/docs is Swagger UI from an installed package, not a CDN: in a browser whose every
    request to another origin is refused, it renders the whole surface under its CSP."""
    ctx = browser.new_context(extra_http_headers=AUTH)
    pg = ctx.new_page()
    foreign, errors = [], []
    pg.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server.url)
             else (foreign.append(route.request.url), route.abort()))
    pg.on("console", lambda m: m.type == "error" and errors.append(m.text))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    r = pg.goto(server.url + "/docs")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    expect()(pg.locator(".opblock-summary-path", has_text="/v1/completions").first).to_be_visible(timeout=20000)
    paths = {t.strip() for t in pg.locator(".opblock-summary-path").all_inner_texts()}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/tokenize", "/health"} <= paths
    ctx.close()
    assert not foreign and not errors, (foreign, errors)
    assert server.get("/redoc", headers=AUTH).status_code == 404  # ReDoc would load from a CDN
