"""The playground page (tfserve/frontends/static/index.html) in a real browser.

Headless Chromium, driven by Selenium through chromedriver, opens `/` on a real server's HTTP
front end serving the bundled demo model, types into the page and presses its buttons as a
user would. What the page shows is compared with what the gRPC API answers for the same
request: the page must send the options it was given and show what the server said.

Every wait is a WebDriverWait on the page's state (a row's `data-state`, the model panel's
`data-state`, the error line's text) or a Gate on the server's decoder steps, never a sleep.
Skipped when chromium or chromedriver is missing (Debian: `apt-get install chromium
chromium-driver`; .ci/run installs them through docker/ci-setup.sh).

TFSERVE_PLAYGROUND_SCREENSHOT=docs/playground.png saves the page after a translation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Gate, ServerThread, free_port, server_args

from tfserve.client import Client

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="the browser tests need chromium and chromedriver on PATH "
           "(Debian: apt-get install chromium chromium-driver)")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -e '.[ecosystem]')")
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

TEXT = "three hundred and forty-two"
FRENCH = "trois cent quarante-deux"
TOKEN = "playground-secret"


# -- fixtures -------------------------------------------------------------------------------


class Served:
    """A ServerThread with its HTTP front end: the page's address and a gRPC client."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.thread = ServerThread(server_args(model, "--http-port", str(free_port()), *extra))

    @property
    def url(self) -> str:
        """The page's address (once the server is started)."""
        return f"{self.thread.http_url}/"

    def client(self, token: str | None = None) -> Client:
        return Client(self.thread.target, timeout=60, token=token)


@pytest.fixture(scope="module")
def served(demo_model: Path) -> Iterator[Served]:
    running = Served(demo_model)
    with running.thread:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1200,800", "--lang=en-US"):
        options.add_argument(argument)
    # an explicit driver: Selenium Manager (which would look for one online) is not used
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The playground in the browser, by its element ids."""

    def __init__(self, driver: Any, url: str) -> None:
        self.driver = driver
        driver.get(url)  # a fresh page: no state left by the previous test
        self.wait(lambda: self.attribute("model-info", "data-state") != "loading",
                  "the model panel stayed 'loading'")

    def wait(self, condition: Callable[[], Any], message: str) -> Any:
        """Wait for a state of the page (60 s is a safety net, not a synchronisation)."""
        return WebDriverWait(
            self.driver, 60,
            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
        ).until(lambda _: condition(), message)

    def element(self, selector: str) -> Any:
        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def attribute(self, element_id: str, name: str) -> str:
        return self.driver.find_element(By.ID, element_id).get_attribute(name) or ""

    def text(self, selector: str) -> str:
        return self.element(selector).text

    def fill(self, element_id: str, value: str) -> None:
        field = self.driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)

    def mode(self, value: str) -> None:
        Select(self.driver.find_element(By.ID, "mode")).select_by_value(value)

    def translate(self, *texts: str) -> None:
        self.fill("texts", "\n".join(texts))
        self.driver.find_element(By.ID, "translate").click()

    def row_state(self, index: int) -> str:
        return self.attribute(f"row-{index}", "data-state")

    def wait_rows(self, count: int, state: str = "done") -> None:
        self.wait(lambda: [self.row_state(i) for i in range(count)] == [state] * count,
                  f"rows did not reach '{state}'; error line: {self.text('#error')!r}")

    def translation(self, index: int) -> str:
        return self.text(f"#row-{index} .translation")

    def hypotheses(self, index: int) -> list[str]:
        items = self.driver.find_elements(By.CSS_SELECTOR, f"#row-{index} .hypotheses .text")
        return [item.text for item in items]

    def meta(self, index: int) -> str:
        return self.text(f"#row-{index} .meta")


@pytest.fixture
def page(browser: Any, served: Served) -> Page:
    return Page(browser, served.url)


def refusal(url: str, body: dict[str, Any] | None = None) -> str:
    """The error.message the HTTP API answers for this request (which must fail)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    return json.loads(error.value.read())["error"]["message"]


def describe(tokens: int, score: float) -> str:
    """What the page writes under a hypothesis."""
    return f"{tokens} token{'' if tokens == 1 else 's'}, score {score:.3f}"


# -- tests ----------------------------------------------------------------------------------


def test_model_info_shows_on_load(page: Page, served: Served) -> None:
    with served.client() as client:
        info = client.model_info()
    assert page.attribute("model-info", "data-state") == "loaded"
    panel = page.text("#model-info")
    assert info.model_name in panel
    assert f"{info.source_language} → {info.target_language}" in panel
    assert f"Texts per request\n{info.limits.max_texts_per_request}" in panel
    assert f"Beams at most\n{info.limits.max_beams}" in panel
    assert page.text("#error") == ""
    # the limits become hints on the inputs
    assert page.attribute("max-new-tokens", "max") == str(info.max_target_tokens - 1)
    assert page.attribute("max-new-tokens", "placeholder") == (
        f"default {info.limits.default_max_new_tokens}")


def test_translation_streams_in(page: Page, served: Served) -> None:
    """With the decoder held after its first step, the row already shows the start of the
    translation (still 'streaming'); let go, it ends with the whole of it."""
    with Gate(served.thread.scheduler) as gate:
        page.translate(TEXT)
        gate.wait_held()
        gate.step()  # the first token is decided and sent; the worker holds before the next
        page.wait(lambda: page.row_state(0) == "streaming" and page.translation(0) != "",
                  "no text arrived while the decoder was held")
        partial = page.translation(0)
        assert FRENCH.startswith(partial) and partial != FRENCH
        assert page.attribute("output", "aria-busy") == "true"
        assert page.element("#stop").is_enabled()
        gate.open()
        page.wait_rows(1)
    assert page.translation(0) == FRENCH
    with served.client() as client:
        [[best]] = client.translate_hypotheses([TEXT])
    assert page.meta(0) == describe(len(best.token_ids), best.score)
    assert page.attribute("output", "aria-busy") == "false"
    assert page.text("#error") == ""


def test_stop(page: Page, served: Served) -> None:
    """Stop ends the translation in progress: the row keeps what came and says 'stopped'."""
    with Gate(served.thread.scheduler) as gate:
        page.translate(TEXT)
        gate.wait_held()
        gate.step()
        page.wait(lambda: page.translation(0) != "", "no text arrived while the decoder was held")
        page.element("#stop").click()
        page.wait_rows(1, "stopped")
    assert page.text("#status") == "Stopped"
    assert page.text("#error") == ""
    assert not page.element("#stop").is_enabled()
    assert FRENCH.startswith(page.translation(0))


def test_each_line_gets_its_row(page: Page, served: Served) -> None:
    """Lines typed in the box, blank ones skipped, sent with Ctrl+Enter from the keyboard."""
    lines = [TEXT, "seven", "twenty one", "eight thousand and five"]
    field = page.driver.find_element(By.ID, "texts")
    field.send_keys(f"{lines[0]}\n\n{lines[1]}\n  \n{lines[2]}\n{lines[3]}")
    field.send_keys(Keys.CONTROL, Keys.ENTER)
    page.wait_rows(len(lines))
    with served.client() as client:
        expected = client.translate(lines)
    assert expected[:3] == [FRENCH, "sept", "vingt et un"]
    assert [page.translation(i) for i in range(len(lines))] == expected
    assert [page.text(f"#row-{i} .source") for i in range(len(lines))] == lines
    assert page.driver.find_elements(By.ID, f"row-{len(lines)}") == []
    screenshot = os.environ.get("TFSERVE_PLAYGROUND_SCREENSHOT")
    if screenshot:
        # the page at 1200x800 CSS pixels (the window's size includes the browser's frame)
        page.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        page.driver.execute_script("document.activeElement.blur();"
                                   "document.getElementById('texts').scrollTop = 0;")
        page.driver.save_screenshot(screenshot)
        page.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_sampling_with_a_seed(page: Page, served: Served) -> None:
    """The page sends the sampling options: its sample is the gRPC API's for the same seed,
    and pressing Translate again draws the same one."""
    page.mode("sample")
    assert page.element("#sample-options").is_displayed()
    assert not page.element("#beam-options").is_displayed()
    for element_id, value in (("temperature", "1.5"), ("top-k", "20"), ("top-p", "0.95"),
                              ("seed", "7"), ("num-return-sequences", "2")):
        page.fill(element_id, value)
    page.translate(TEXT)
    page.wait_rows(1)
    with served.client() as client:
        [samples] = client.translate_hypotheses([TEXT], do_sample=True, temperature=1.5,
                                                top_k=20, top_p=0.95, seed=7,
                                                num_return_sequences=2)
    assert page.hypotheses(0) == [sample.text for sample in samples]
    assert page.translation(0) == samples[0].text != ""
    assert page.meta(0) == describe(len(samples[0].token_ids), samples[0].score)
    first = page.hypotheses(0)
    page.element("#translate").click()
    page.wait_rows(1)
    assert page.hypotheses(0) == first


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_beam_search(page: Page, served: Served, stream: bool) -> None:
    page.mode("beam")
    page.fill("num-beams", "4")
    page.fill("length-penalty", "0.5")
    page.fill("num-return-sequences", "3")
    if not stream:
        page.element("#stream").click()
    page.translate(TEXT, "seven")
    page.wait_rows(2)
    with served.client() as client:
        expected = client.translate_hypotheses([TEXT, "seven"], num_beams=4, length_penalty=0.5,
                                               num_return_sequences=3)
    for index, hypotheses in enumerate(expected):
        assert page.hypotheses(index) == [h.text for h in hypotheses]
        assert page.translation(index) == hypotheses[0].text
        assert page.meta(index) == describe(len(hypotheses[0].token_ids), hypotheses[0].score)
    assert page.translation(0) == FRENCH


def test_the_servers_error_is_shown(page: Page, served: Served) -> None:
    page.fill("max-new-tokens", "100000")
    page.translate(TEXT)
    page.wait(lambda: page.text("#error") != "", "no error shown")
    message = refusal(served.url + "v1/translate:stream",
                      {"texts": [TEXT], "options": {"maxNewTokens": 100000}})
    assert "max_new_tokens" in message
    assert page.text("#error") == message
    page.wait_rows(1, "error")
    # the error goes with the next good request
    page.fill("max-new-tokens", "")
    page.translate(TEXT)
    page.wait_rows(1)
    assert page.text("#error") == ""
    assert page.translation(0) == FRENCH


def test_inputs_checked_before_sending(page: Page) -> None:
    page.mode("sample")
    page.fill("seed", "-3")
    page.translate(TEXT)
    assert page.text("#error") == "Seed must be a whole number >= 0, got -3"
    assert page.driver.find_elements(By.ID, "row-0") == []  # nothing was sent
    page.translate("")
    assert page.text("#error") == "Type a text to translate (one per line)."


def test_each_option_the_server_takes_has_its_control(page: Page, served: Served) -> None:
    """The page builds its decoding controls from the server's schema of DecodingOptions
    (GET /openapi.json, from tfserve.option_table): one per option but doSample (the mode
    itself), labelled with its title, shown in the modes whose search reads it."""
    with urllib.request.urlopen(served.url + "openapi.json", timeout=60) as answer:
        document = json.loads(answer.read())
    properties = document["components"]["schemas"]["DecodingOptions"]["properties"]
    assert len(properties) > 10
    for mode in ("greedy", "beam", "sample"):
        page.mode(mode)
        for key, schema in properties.items():
            if key == "doSample":
                continue
            element_id = re.sub("[A-Z]", lambda letter: f"-{letter.group().lower()}", key)
            searches = schema["x-tfserve-searches"]
            shown = page.element(f"#{element_id}").is_displayed()
            assert shown == (not searches or mode in searches), (mode, key)
            label = page.element(f'label[for="{element_id}"]')
            assert label.get_attribute("textContent").strip() == schema["title"], key


def test_the_controls_of_every_search_reach_the_server(page: Page, served: Served) -> None:
    """Options every search reads (the repetition controls, min new tokens) go with a greedy
    translation: the page shows what the gRPC API answers for the same options."""
    for element_id, value in (("min-new-tokens", "2"), ("repetition-penalty", "1.5"),
                              ("no-repeat-ngram-size", "2")):
        page.fill(element_id, value)
    page.translate(TEXT)
    page.wait_rows(1)
    with served.client() as client:
        [[best]] = client.translate_hypotheses([TEXT], num_beams=1, min_new_tokens=2,
                                               repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert page.translation(0) == best.text != ""
    assert page.meta(0) == describe(len(best.token_ids), best.score)


# a body in every form the event-stream format allows: \r\n, \r and \n line ends, a comment,
# data over two lines (one without the space after the colon), named events, UTF-8 beyond ASCII
EVENT_STREAM = ('data: {"textDelta": "quatre-vingt-dix-huit, é"}\r\n\r\n'
                ": a comment\n"
                "data: first\r\ndata:second\r\n\r\n"
                'event: error\rdata: {"error": {}}\r\r'
                "event: done\ndata: {}\n\n")
EVENTS = [{"type": "message", "data": '{"textDelta": "quatre-vingt-dix-huit, é"}'},
          {"type": "message", "data": "first\nsecond"},
          {"type": "error", "data": '{"error": {}}'},
          {"type": "done", "data": "{}"}]


@pytest.mark.parametrize("ending, events", [
    ("", EVENTS),
    ("data: an event the body ends before its blank line", EVENTS),
    ("data: ended by a last \\r\r\r", [*EVENTS, {"type": "message",
                                                "data": "ended by a last \\r"}]),
], ids=["whole", "unfinished", "cr-at-end"])
def test_event_stream_reader(page: Page, ending: str, events: list[dict[str, str]]) -> None:
    """The page's reader of server-sent events (fetch bodies arrive in pieces cut anywhere):
    the same events from the body in one piece, cut in two at every byte, and byte by byte."""
    page.driver.set_script_timeout(60)
    results = page.driver.execute_async_script("""
        const [text, finish] = arguments;
        const bytes = new TextEncoder().encode(text);
        async function read(cuts) {
          const body = new ReadableStream({ start(controller) {
            let at = 0;
            for (const cut of [...cuts, bytes.length]) {
              controller.enqueue(bytes.slice(at, cut));
              at = cut;
            }
            controller.close();
          } });
          const events = [];
          for await (const event of serverSentEvents(body)) events.push(event);
          return events;
        }
        (async () => {
          const results = [await read([])];
          for (let cut = 1; cut < bytes.length; cut++) results.push(await read([cut]));
          results.push(await read([...Array(bytes.length).keys()].slice(1)));
          return results;
        })().then(finish, (error) => finish(String(error)));
    """, EVENT_STREAM + ending)
    assert isinstance(results, list), results
    assert len(results) == len((EVENT_STREAM + ending).encode()) + 1
    for result in results:
        assert result == events


def test_bearer_token(browser: Any, demo_model: Path) -> None:
    """A server with --auth-token: without the token the page shows the server's refusal;
    with it typed in, the model panel loads and translations work."""
    secured = Served(demo_model, "--auth-token", TOKEN)
    with secured.thread:
        page = Page(browser, secured.url)
        assert page.attribute("model-info", "data-state") == "error"
        assert page.text("#error") == f"Model info: {refusal(secured.url + 'v1/model')}"
        assert page.attribute("token-details", "open") == "true"  # opened for the token
        page.fill("token", TOKEN + Keys.TAB)  # the change event
        page.wait(lambda: page.attribute("model-info", "data-state") == "loaded",
                  "the model panel did not load with the token")
        assert page.text("#error") == ""
        assert browser.execute_script(
            "return sessionStorage.getItem('tfserve.playground.token')") == TOKEN
        page.translate(TEXT)
        page.wait_rows(1)
        assert page.translation(0) == FRENCH
        browser.execute_script("sessionStorage.clear()")


def test_a_repository_server_offers_a_choice_of_model(browser: Any, demo_model: Path,
                                                      random_model: Path,
                                                      tmp_path: Path) -> None:
    """A server of several models (--model-repository): the page lists them, shows the chosen
    one's info, and sends each translation to the chosen model."""
    repository = tmp_path / "repository"
    repository.mkdir()
    shutil.copytree(demo_model, repository / "numbers")
    shutil.copytree(random_model, repository / "random")
    args = ["--model-repository", str(repository), "--default-model", "numbers", "--host",
            "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", str(free_port()),
            "--threads", "1", "--log-level", "warning"]
    with ServerThread(args) as server:
        page = Page(browser, f"{server.http_url}/")
        choice = Select(page.driver.find_element(By.ID, "model-choice"))
        assert page.driver.find_element(By.ID, "model-choice").is_displayed()
        assert [option.text for option in choice.options] == ["numbers", "random"]
        assert choice.first_selected_option.text == "numbers"  # the default model
        assert "tfserve-demo-en-fr-numbers" in page.text("#model-info")
        page.translate(TEXT)
        page.wait_rows(1)
        assert page.translation(0) == FRENCH
        choice.select_by_value("random")
        page.wait(lambda: "random-test-model" in page.text("#model-info"),
                  "the model panel did not show the chosen model")
        page.fill("max-new-tokens", "3")
        page.translate(TEXT)
        page.wait_rows(1)
        count = server.metrics.value
        assert count("tfserve_requests_total",
                     {"model": "random", "rpc": "Translate", "code": "OK"}) + count(
            "tfserve_requests_total",
            {"model": "random", "rpc": "TranslateStream", "code": "OK"}) == 1
        assert page.text("#error") == ""


def test_an_encoder_only_model_embeds(browser: Any, tmp_path: Path) -> None:
    """A T5 encoder (ModelInfo.decoder_layers 0): the page offers Embed instead of the
    decoding options, and shows each line's embedding as the gRPC Encode answers it, with its
    size, tokens, norm and cosine to the first line."""
    pytest.importorskip("transformers")
    import t5_helpers as th

    from export.cli import main as export_main

    checkpoint, out = tmp_path / "hf", tmp_path / "encoder"
    th.write_encoder_checkpoint(checkpoint, th.train_t5_spm(), d_model=36, d_kv=10, d_ff=52,
                                num_layers=2, num_heads=3, relative_attention_num_buckets=12,
                                relative_attention_max_distance=20,
                                feed_forward_proj="gated-gelu")
    assert export_main(["--from-hf", str(checkpoint), "--out", str(out), "--quiet"]) == 0
    running = Served(out)
    with running.thread:
        page = Page(browser, running.url)
        assert page.text("#translate") == "Embed"
        assert page.text("#output-title") == "Embeddings"
        assert not page.element("#decoding-options").is_displayed()
        assert "Encoder: sentence embeddings" in page.text("#model-info")
        texts = ["the cat sat on the mat", "one two three"]
        page.translate(*texts)
        page.wait_rows(2)
        with running.client() as client:
            answers = client.encode(texts)
        for index, answer in enumerate(answers):
            shown = page.translation(index)
            assert shown.startswith("[") and shown.endswith(", …]"), shown
            values = [float(v) for v in shown[1:-len(", …]")].split(", ")]
            assert values == pytest.approx(answer.embedding[:6].tolist(), abs=6e-4)
            meta = page.meta(index)
            assert meta.startswith(f"{answer.embedding.size} values, "
                                   f"{len(answer.token_ids)} tokens, norm "), meta
        assert page.meta(0).endswith("cosine to line 1 1.000")
        first, second = (answer.embedding.astype(float) for answer in answers)  # as JS
        similarity = float(first @ second / ((first @ first) * (second @ second)) ** 0.5)
        assert page.meta(1).endswith(f"cosine to line 1 {similarity:.3f}")


# -- documents (issue 36) -------------------------------------------------------------------


def answered(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The first Translation the HTTP API answers for this request."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["translations"][0]


@pytest.mark.parametrize(("kind", "document"), [
    ("text", "seven. twenty-one.\n\n  - three hundred and forty-two.\n"),
    ("html", "<h1>seven</h1>\n<p>twenty-one. <b>eight</b>.</p>"),
])
@pytest.mark.parametrize("stream", [True, False])
def test_a_pasted_document_comes_back_in_its_layout(page: Page, served: Served, kind: str,
                                                    document: str, stream: bool) -> None:
    """Document mode sends the whole input as one text with its format: the row shows the
    server's answer as it is (line breaks, indentation, markup as text), streamed or not,
    with the number of segments."""
    Select(page.driver.find_element(By.ID, "input-kind")).select_by_value(kind)
    if not stream:
        page.driver.find_element(By.ID, "stream").click()
    page.fill("texts", document)
    page.driver.find_element(By.ID, "translate").click()
    page.wait_rows(1)
    expected = answered(f"{served.thread.http_url}/v1/translate",
                        {"texts": [document], "format": kind, "options": {"numBeams": 1}})
    shown = page.element("#row-0 .translation").get_attribute("textContent")
    assert shown == expected["hypotheses"][0]["text"]
    assert page.element("#row-0 .source").get_attribute("textContent") == document
    assert f"{len(expected['segments'])} segments" in page.meta(0)
    assert "document" in page.attribute("row-0", "class")
