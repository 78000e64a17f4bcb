"""Languages, target prefixes, repetition controls and generation defaults through the wire:
gRPC, HTTP/JSON, the Python client and the CLI, against a served NLLB-style model.

A tiny random NLLB-200-style checkpoint (M2M100ForConditionalGeneration with NllbTokenizer
and four language codes; tests/family_helpers.py) is exported with `python -m export
--from-hf` and served from a repository of two models: `nllb` as exported, and `nllb-beams3`,
the same artifacts whose model.json records a generation_config.json asking for num_beams 3,
early_stopping and forced_eos_token_id (eos ends an output that reaches max_new_tokens).
Answers are compared with the Translator on the same artifacts (which tests/export/test_families.py
checks against transformers) and, for the repetition controls, with transformers' generate
itself. Nothing is downloaded; transformers is a test-only dependency (skipped without it).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only, never the hub
transformers = pytest.importorskip("transformers")

import family_helpers as fh  # noqa: E402
import torch  # noqa: E402
from server_helpers import (  # noqa: E402
    Gate,
    ServerThread,
    free_port,
    http_json,
    wait_queued,
)

from export.cli import main as export_main  # noqa: E402
from tfserve import cli  # noqa: E402
from tfserve.client import Client, ServerError  # noqa: E402
from tfserve.translator import Translator  # noqa: E402

SOURCE = "eng_Latn"
TEXTS = fh.sentences(4, seed=31)
TRANSPORTS = ("grpc", "http")
# the generation defaults recorded for nllb-beams3 (2 is the model's eos), and the options
# they give
BEAMS3 = {"num_beams": 3, "early_stopping": True, "forced_eos_token_id": 2}
BEAMS3_OPTIONS = {"num_beams": 3, "early_stopping": True, "forced_eos": True}
# the options of the requests that share a batch: every row lives at least MIN_NEW steps
# (eos is banned before), so that rows joining a few steps later find the others running
MIN_NEW, MAX_NEW = 8, 14


# -- the model and the server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(directory, the transformers model, its tokenizer) of the NLLB-style checkpoint."""
    directory = tmp_path_factory.mktemp("hf") / "nllb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = fh.write_checkpoint("nllb", directory, seed=0)
    return directory, model, tokenizer


@pytest.fixture(scope="module")
def repository(checkpoint: tuple[Path, Any, Any],
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model repository: nllb (as exported) and nllb-beams3 (BEAMS3 recorded)."""
    directory = tmp_path_factory.mktemp("repository")
    plain = directory / "nllb"
    assert export_main(["--from-hf", str(checkpoint[0]), "--out", str(plain), "--quiet"]) == 0
    beams = directory / "nllb-beams3"
    shutil.copytree(plain, beams)
    manifest = json.loads((beams / "model.json").read_text(encoding="utf-8"))
    manifest["generation"] = {**manifest.get("generation", {}), **BEAMS3}
    (beams / "model.json").write_text(json.dumps(manifest), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def translator(repository: Path) -> Translator:
    return Translator(repository / "nllb", intra_op_threads=1)


@pytest.fixture(scope="module")
def server(repository: Path) -> Any:
    # --max-wait-ms 0 --wave-wait-steps 0: queued requests join a running batch at the
    # worker's next pass, not after a wait in real time (the shared-batch test steps the
    # decoder by hand and counts the rows that joined)
    args = ["--model-repository", str(repository), "--default-model", "nllb",
            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--http-port", str(free_port()), "--threads", "1", "--log-level", "warning",
            "--max-wait-ms", "0", "--wave-wait-steps", "0"]
    with ServerThread(args) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    with Client(server.target, timeout=120) as connected:
        yield connected


# -- one request over either transport ------------------------------------------------------

# the client's keyword arguments -> the JSON mapping of TranslateRequest
JSON_NAMES = {"source_language": "sourceLanguage", "target_language": "targetLanguage",
              "target_prefix": "targetPrefix", "model": "model"}
JSON_OPTIONS = {"max_new_tokens": "maxNewTokens", "min_new_tokens": "minNewTokens",
                "num_beams": "numBeams", "repetition_penalty": "repetitionPenalty",
                "no_repeat_ngram_size": "noRepeatNgramSize", "early_stopping": "earlyStopping"}


def http_call(server: ServerThread, method: str, path: str, body: Any = None
              ) -> tuple[int, Any]:
    """An HTTP call: its status and JSON answer."""
    return http_json(server, method, path, body, timeout=120)


def translate(transport: str, server: ServerThread, client: Client, texts: list[str],
              **kwargs: Any) -> list[tuple[list[int], float, str]]:
    """(token ids, score, text) of each text's best hypothesis, asked over `transport`;
    ServerError (gRPC) or (status, code, message) raised as ServerError for HTTP too."""
    # each text one sequence (split_sentences false), as the Translator's translate_hypotheses
    # that the answers are compared with (a server splits each text into sentences by
    # default: issue 36, tests/serving/test_documents_languages.py)
    if transport == "grpc":
        return [(h[0].token_ids, h[0].score, h[0].text)
                for h in client.translate_hypotheses(texts, split_sentences=False, **kwargs)]
    prefix = kwargs.pop("target_prefix", None)
    body: dict[str, Any] = {"texts": texts, "options": {}, "splitSentences": False}
    if prefix is not None:
        body["targetPrefix"] = [prefix] if isinstance(prefix, str) else list(prefix)
    for name, value in kwargs.items():
        if name in JSON_NAMES:
            body[JSON_NAMES[name]] = value
        else:
            body["options"][JSON_OPTIONS[name]] = value
    status, answer = http_call(server, "POST", "/v1/translate", body)
    if status != 200:
        raise ServerError(getattr(grpc.StatusCode, answer["error"]["code"]),
                          answer["error"]["message"])
    return [([int(t) for t in tr["hypotheses"][0].get("tokenIds", [])],
             tr["hypotheses"][0].get("score", 0.0), tr["hypotheses"][0].get("text", ""))
            for tr in answer["translations"]]


def offline(translator: Translator, texts: list[str], **kwargs: Any) -> list[list[int]]:
    return [h[0].token_ids for h in translator.translate_hypotheses(texts, **kwargs)]


def tokens(answers: list[tuple[list[int], float, str]]) -> list[list[int]]:
    return [token_ids for token_ids, _, _ in answers]


# -- languages ------------------------------------------------------------------------------

# three requests into three languages, with different searches and per-text target prefixes
MIXED = (
    dict(target_language="fra_Latn"),
    dict(target_language="deu_Latn", num_beams=3),
    dict(target_language="spa_Latn", target_prefix=["the big", "", "a cat", "the"]),
)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requests_into_different_languages_share_a_batch_and_answer_as_alone(
        transport: str, server: ServerThread, client: Client, translator: Translator) -> None:
    """The first request holds the decoder (a Gate); the other two queue and join its batch
    between two steps: a step then decodes the rows of all three languages. Each answer
    equals the same request alone and the Translator's."""
    common = dict(source_language=SOURCE, min_new_tokens=MIN_NEW, max_new_tokens=MAX_NEW)
    requests = [{**common, **extra} for extra in MIXED]
    rows = [len(TEXTS) * extra.get("num_beams", 1) for extra in MIXED]
    scheduler = server.repository.loaded("nllb").scheduler
    with ThreadPoolExecutor(len(requests)) as pool:
        with Gate(scheduler) as gate:
            first = pool.submit(translate, transport, server, client, TEXTS, **requests[0])
            assert gate.wait_held() == rows[0]
            later = [pool.submit(translate, transport, server, client, TEXTS, **kwargs)
                     for kwargs in requests[1:]]
            wait_queued(scheduler, 2 * len(TEXTS))
            for _ in range(MIN_NEW - 2):  # every row lives MIN_NEW steps
                gate.step()
                if gate.wait_held() == sum(rows):
                    break
            assert gate.wait_held() == sum(rows), gate.calls
        together = [first.result(120)] + [answer.result(120) for answer in later]
    for kwargs, shared in zip(requests, together):
        alone = translate(transport, server, client, TEXTS, **kwargs)
        assert tokens(shared) == tokens(alone) == offline(translator, TEXTS, **kwargs), kwargs
        assert [score for _, score, _ in shared] == pytest.approx(
            [score for _, score, _ in alone], abs=1e-4)
    codes = translator.tokenizer.languages.codes
    for kwargs, answers in zip(requests, together):
        # the target language token is each output's first token, not part of its text
        assert all(ids[0] == codes[kwargs["target_language"]] for ids in tokens(answers))
    for (ids, _, text), prefix in zip(together[2], MIXED[2]["target_prefix"]):
        assert text.startswith(prefix)
        assert ids[1: 1 + len(translator.tokenizer.encode_text(prefix))] == \
            translator.tokenizer.encode_text(prefix)


def test_a_streamed_translation_starts_with_its_target_prefix(client: Client,
                                                              translator: Translator) -> None:
    chunks = list(client.translate_stream(TEXTS[:1], source_language=SOURCE,
                                          target_language="deu_Latn", target_prefix="the big",
                                          max_new_tokens=6))
    text = "".join(chunk.text_delta for chunk in chunks)
    assert text.startswith("the big") and text == chunks[-1].final.text
    assert chunks[-1].final.token_ids == offline(translator, TEXTS[:1], target_language="deu_Latn",
                                                 target_prefix="the big", max_new_tokens=6)[0]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kwargs, message", [
    (dict(), "target_language is required by this multilingual model; valid codes include "
             "eng_Latn, fra_Latn, deu_Latn, spa_Latn"),
    (dict(target_language="fr"), "target_language 'fr' is not a language of this model; "
                                 "valid codes include fra_Latn"),
    (dict(target_language="fra_Latn", source_language="english"),
     "source_language 'english' is not a language of this model; valid codes include "
     "eng_Latn"),
    (dict(target_language="fra_Latn", target_prefix=["a", "b </s>", "c", "d"]),
     "target_prefix[1] must not contain the end-of-sequence token ('</s>')"),
    (dict(target_language="fra_Latn", target_prefix=["the " * 200]),
     "target_prefix[0] is "),
    (dict(target_language="fra_Latn", target_prefix=["a", "b"]),
     "target_prefix holds 2 items for 4 inputs: give none, one for every input, or one per "
     "input"),
    (dict(target_language="fra_Latn", repetition_penalty=0.0),
     "options.repetition_penalty must be in [0.1, 10.0] (1.0: off), got 0.0"),
    (dict(target_language="fra_Latn", repetition_penalty=11.0),
     "options.repetition_penalty must be in [0.1, 10.0]"),
    (dict(target_language="fra_Latn", no_repeat_ngram_size=65),
     "options.no_repeat_ngram_size must be in [0, 64], got 65"),
    (dict(target_language="fra_Latn", no_repeat_ngram_size=-1),
     "options.no_repeat_ngram_size must be in [0, 64], got -1"),
    (dict(target_language="fra_Latn", num_beams=40), "options.num_beams must be in [1, 16]"),
])
def test_bad_languages_prefixes_and_controls_name_the_field(
        transport: str, kwargs: dict[str, Any], message: str, server: ServerThread,
        client: Client) -> None:
    with pytest.raises(ServerError) as raised:
        translate(transport, server, client, TEXTS, max_new_tokens=4, **kwargs)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(message), raised.value.details()


def test_token_ids_take_a_target_language_but_no_source_language(
        client: Client, translator: Translator) -> None:
    sources = [translator.tokenizer.encode(text, SOURCE) for text in TEXTS]
    answers = client.translate_hypotheses(token_ids=sources, target_language="fra_Latn",
                                          max_new_tokens=6)
    assert [h[0].token_ids for h in answers] == offline(
        translator, TEXTS, source_language=SOURCE, target_language="fra_Latn",
        max_new_tokens=6)
    with pytest.raises(ServerError) as raised:
        client.translate(token_ids=sources, source_language=SOURCE, target_language="fra_Latn")
    assert raised.value.details().startswith("source_language applies to texts")


def test_encode_places_the_requests_source_language(server: ServerThread, client: Client,
                                                    translator: Translator) -> None:
    """Encode frames each text with the request's source language, as Translate does; an
    unknown code is refused naming the field, over both transports."""
    for language in (SOURCE, "fra_Latn"):
        expected = [translator.tokenizer.encode(text, language) for text in TEXTS]
        assert [e.token_ids for e in client.encode(TEXTS, source_language=language)] == expected
        status, answer = http_call(server, "POST", "/v1/encode",
                                   {"texts": TEXTS, "sourceLanguage": language})
        assert status == 200
        assert [[int(i) for i in e["tokenIds"]] for e in answer["embeddings"]] == expected
    assert expected != [translator.tokenizer.encode(text, SOURCE) for text in TEXTS]
    with pytest.raises(ServerError) as raised:
        client.encode(TEXTS, source_language="xxx_Latn")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("source_language"), raised.value.details()
    status, answer = http_call(server, "POST", "/v1/encode",
                               {"texts": TEXTS, "sourceLanguage": "xxx_Latn"})
    assert status == 400 and answer["error"]["message"].startswith("source_language")


def test_min_new_tokens_zero_overrides_a_model_minimum() -> None:
    """DecodingOptions.min_new_tokens is optional: unset takes the model's min_length, an
    explicit 0 sets no minimum against it."""
    from tfserve.artifacts.generation_defaults import GenerationDefaults
    from tfserve.frontends.messages import option_fields, pb2

    defaults = GenerationDefaults({"min_new_tokens": 5})
    unset = option_fields(pb2.DecodingOptions(max_new_tokens=9))
    zero = option_fields(pb2.DecodingOptions(max_new_tokens=9, min_new_tokens=0))
    assert unset.min_new_tokens is None and zero.min_new_tokens == 0
    assert defaults.merge({"max_new_tokens": 9})["min_new_tokens"] == 5
    assert defaults.merge({"max_new_tokens": 9, "min_new_tokens": 0})["min_new_tokens"] == 0


# -- repetition controls --------------------------------------------------------------------


def hf_tokens(checkpoint: tuple[Path, Any, Any], texts: list[str], target: str,
              **settings: Any) -> list[list[int]]:
    """transformers' greedy output ids (the start token, eos and padding left out)."""
    directory, model, tokenizer = checkpoint
    tokenizer.src_lang = SOURCE
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, forced_bos_token_id=tokenizer.convert_tokens_to_ids(
            target), bad_words_ids=[[model.config.pad_token_id]], num_beams=1,
            do_sample=False, forced_eos_token_id=None, **settings)
    special = {model.config.pad_token_id, model.config.eos_token_id}
    return [[int(t) for t in row[1:] if int(t) not in special] for row in out]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("controls", [dict(repetition_penalty=1.6),
                                      dict(no_repeat_ngram_size=2),
                                      dict(repetition_penalty=0.7, no_repeat_ngram_size=3)])
def test_repetition_controls_change_the_answer_as_transformers_and_the_translator(
        transport: str, controls: dict[str, Any], server: ServerThread, client: Client,
        translator: Translator, checkpoint: tuple[Path, Any, Any]) -> None:
    request = dict(source_language=SOURCE, target_language="fra_Latn", max_new_tokens=16,
                   num_beams=1)
    plain = tokens(translate(transport, server, client, TEXTS, **request))
    controlled = tokens(translate(transport, server, client, TEXTS, **request, **controls))
    assert controlled != plain
    assert controlled == offline(translator, TEXTS, **request, **controls)
    assert controlled == hf_tokens(checkpoint, TEXTS, "fra_Latn", max_new_tokens=16,
                                   **controls)


# -- model info and generation defaults -----------------------------------------------------


def test_model_info_lists_languages_and_generation_defaults(server: ServerThread,
                                                            client: Client) -> None:
    codes = list(fh.NLLB_CODES)
    plain = client.model_info(model="nllb")
    beams = client.model_info(model="nllb-beams3")
    for info in (plain, beams):
        assert list(info.languages) == codes
        assert info.source_language == SOURCE  # the default of a request without one
    assert not plain.generation_defaults.HasField("num_beams")
    assert beams.generation_defaults.HasField("num_beams")
    assert beams.generation_defaults.num_beams == 3
    assert beams.generation_defaults.early_stopping == "true"
    assert beams.generation_defaults.forced_eos and not plain.generation_defaults.forced_eos
    assert list(beams.generation_defaults.unapplied) == []
    assert plain.generation_defaults.early_stopping == ""
    assert json.loads(beams.generation_defaults.recorded_json) == {
        "decoder_start_token_id": 2, **BEAMS3}
    status, body = http_call(server, "GET", "/v1/models/nllb-beams3")
    assert status == 200
    assert body["languages"] == codes
    assert body["generationDefaults"]["numBeams"] == 3
    assert body["generationDefaults"]["earlyStopping"] == "true"
    status, body = http_call(server, "GET", "/v1/model")  # the default model: nllb
    assert status == 200 and body["model"] == "nllb" and "numBeams" not in body.get(
        "generationDefaults", {})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_generation_defaults_fill_the_options_a_request_leaves_unset(
        transport: str, server: ServerThread, client: Client, translator: Translator) -> None:
    """nllb-beams3 searches with 3 beams and early stopping when num_beams is unset (0 on
    the wire) and early_stopping left out, greedily when the request says num_beams 1, and
    without early stopping when it says early_stopping false, always ending an output at
    max_new_tokens with eos; nllb, which records none of these, greedily without."""
    request = dict(source_language=SOURCE, target_language="deu_Latn", max_new_tokens=12)
    beam3 = offline(translator, TEXTS, **BEAMS3_OPTIONS, **request)
    beam3_late = offline(translator, TEXTS, **{**BEAMS3_OPTIONS, "early_stopping": False},
                         **request)
    greedy_eos = offline(translator, TEXTS, num_beams=1, forced_eos=True, **request)
    greedy = offline(translator, TEXTS, num_beams=1, **request)
    assert len({str(beam3), str(beam3_late), str(greedy_eos), str(greedy)}) == 4

    def served(**kwargs: Any) -> list[list[int]]:
        return tokens(translate(transport, server, client, TEXTS, **request, **kwargs))

    assert served(model="nllb-beams3") == beam3
    assert served(model="nllb-beams3", early_stopping=False) == beam3_late
    assert served(model="nllb-beams3", num_beams=1) == greedy_eos
    assert served(model="nllb") == greedy


# -- the CLI --------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_language_prefix_and_control_flags_offline_and_with_a_server(
        capsys: pytest.CaptureFixture[str], server: ServerThread, repository: Path,
        translator: Translator) -> None:
    flags = ["--source-lang", SOURCE, "--target-lang", "spa_Latn", "--prefix", "the big",
             "--repetition-penalty", "1.4", "--no-repeat-ngram-size", "2",
             "--max-new-tokens", "10", "--json"]
    expected = offline(translator, TEXTS, source_language=SOURCE, target_language="spa_Latn",
                       target_prefix="the big", repetition_penalty=1.4,
                       no_repeat_ngram_size=2, max_new_tokens=10)
    offline_run = run_cli(capsys, ["translate", "--model", str(repository / "nllb"),
                                   "--threads", "1", *flags, *TEXTS])
    served_run = run_cli(capsys, ["translate", "--server", server.target, "--model-name",
                                  "nllb", *flags, *TEXTS])
    for code, out, err in (offline_run, served_run):
        assert code == 0, err
        records = [json.loads(line) for line in out.splitlines()]
        assert [r["hypotheses"][0]["token_ids"] for r in records] == expected
        assert all(r["hypotheses"][0]["text"].startswith("the big") for r in records)
    # the model's generation defaults apply to the flags left out: 3 beams for nllb-beams3,
    # with early stopping unless --no-early-stopping
    for extra, stopping in (([], True), (["--no-early-stopping"], False)):
        code, out, err = run_cli(capsys, ["translate", "--server", server.target,
                                          "--model-name", "nllb-beams3", "--target-lang",
                                          "deu_Latn", "--max-new-tokens", "12", "--json",
                                          *extra, *TEXTS])
        assert code == 0, err
        assert [json.loads(line)["hypotheses"][0]["token_ids"] for line in out.splitlines()] \
            == offline(translator, TEXTS, target_language="deu_Latn",
                       **{**BEAMS3_OPTIONS, "early_stopping": stopping}, max_new_tokens=12)


@pytest.mark.parametrize("where", ["offline", "server"])
def test_cli_without_a_target_language_exits_2_naming_the_field(
        where: str, capsys: pytest.CaptureFixture[str], server: ServerThread,
        repository: Path) -> None:
    model = ["--model", str(repository / "nllb"), "--threads", "1"] if where == "offline" \
        else ["--server", server.target]
    code, out, err = run_cli(capsys, ["translate", *model, "--max-new-tokens", "4", "seven"])
    assert code == 2 and out == ""
    assert "target_language is required by this multilingual model; valid codes include " \
        "eng_Latn" in err and err.count("\n") == 1


# -- the playground -------------------------------------------------------------------------


def test_the_playground_offers_the_models_languages(server: ServerThread, client: Client
                                                    ) -> None:
    """The page shows a multilingual model's languages as two choices (the model's default
    source first) and sends them; its Greedy mode asks for num_beams 1, whatever the model's
    default. Skipped without chromium, chromedriver and selenium, as
    tests/serving/test_playground.py
    is."""
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) or \
            not shutil.which("chromedriver"):
        pytest.skip("the browser tests need chromium and chromedriver on PATH")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from test_playground import CHROMEDRIVER, CHROMIUM, Page

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1200,800"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        page = Page(driver, f"{server.http_url}/")
        Select(driver.find_element(By.ID, "model-choice")).select_by_value("nllb-beams3")
        page.wait(lambda: "Model's decoding defaults\nbeams 3, early stopping true" in
                  page.text("#model-info"), "the chosen model's defaults were not shown")
        assert driver.find_element(By.ID, "target-language").is_displayed()
        source = Select(driver.find_element(By.ID, "source-language"))
        target = Select(driver.find_element(By.ID, "target-language"))
        assert [option.text for option in source.options] == [
            f"{SOURCE} (default)", "Detect (auto)", *fh.NLLB_CODES]
        assert [option.text for option in target.options] == list(fh.NLLB_CODES)
        target.select_by_value("deu_Latn")
        page.fill("max-new-tokens", "12")
        page.translate(*TEXTS)
        page.wait_rows(len(TEXTS))
        expected = client.translate(TEXTS, model="nllb-beams3", target_language="deu_Latn",
                                    num_beams=1, max_new_tokens=12)
        # the text WebDriver reads is trimmed; a text of two sentences whose first one
        # translates to nothing begins with the layout between them (documents: issue 36)
        assert [page.translation(i) for i in range(len(TEXTS))] == [t.strip() for t in expected]
        assert expected != client.translate(TEXTS, model="nllb-beams3",
                                            target_language="deu_Latn", max_new_tokens=12)
        assert page.attribute("row-0", "innerHTML").count('lang="deu-Latn"') == 1
        assert page.text("#error") == ""
    finally:
        driver.quit()
