"""`reformer loadtest --questions-per-doc K` (loadtest/questions.py): each document asked K questions that
declare it as the cached part, against a real server with its prefix cache on and the one-piece prefill (which
reuses declared parts only): the server's hit rate, first against later questions, the prefill tokens saved, and
the A/B without the declaration; and against the default server (the causal prefill on this CPU), where later
questions restore the document with no declaration."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest import cli
from loadtest.documents import Document
from loadtest.questions import Tagger, conversation, question
from tests.loadtest.helpers import API_KEY, running_server

K = 3


@pytest.fixture(scope="module")
def server_url(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real service with the one-piece prefill, whose prefix cache reuses only declared parts."""
    with running_server(tiny_artifact, tmp_path_factory.mktemp("server") / "server.log", prefill="one-piece") as url:
        yield url


@pytest.fixture(scope="module")
def default_url(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(tiny_artifact, tmp_path_factory.mktemp("default") / "server.log") as url:
        yield url


def _run(server_url: str, docs_dir: Path, out: Path, *extra: str) -> dict[str, Any]:
    args = ["--url", server_url, "--docs", str(docs_dir), "--lengths", "512", "--concurrency", "1",
            "--requests", str(2 * K), "--docs-per-length", "2", "--max-new-tokens", "2",
            "--questions-per-doc", str(K), "--out", str(out), "--markdown", str(out.with_suffix(".md")),
            "--strict", "--api-key", API_KEY, *extra]  # fmt: skip
    assert cli.main(args) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["requests"] == row["ok"] == 2 * K and report["metrics_check"]["ok"]
    return report


def test_later_questions_restore_the_document_and_the_server_counts_it(
    server_url: str, docs_dir: Path, tmp_path: Path
) -> None:
    report = _run(server_url, docs_dir, tmp_path / "stream.json")  # the default endpoint: stream
    (row,) = report["results"]
    q = row["questions"]
    assert row["endpoint"] == "stream" and q["documents"] == 2 and q["cache_prefix_declared"]
    assert q["first"]["requests"] == 2 and q["later"]["requests"] == 2 * (K - 1)
    assert q["first"]["cached_tokens"] == 0  # the warm-up sent the same document: its tag kept this one cold
    later = q["later"]
    # the document (tag + text, a few hundred bytes: one token a byte) restored, the question read after it
    assert 2 * (K - 1) * 0.9 * 512 < later["cached_tokens"] < later["prompt_tokens"]
    assert later["prompt_tokens"] - later["cached_tokens"] < 2 * (K - 1) * 60  # only the questions were read
    # the server looked up each request's document and found it for every later question: (K-1)/K exactly
    assert q["hit_rate"] == pytest.approx((K - 1) / K, abs=1e-12)
    assert sum(q["server_hits_tokens"].values()) == q["saved_prefill_tokens"] == later["cached_tokens"]
    assert q["server_hits_tokens"]["memory"] == later["cached_tokens"]
    assert q["saved_fraction"] == pytest.approx(later["cached_tokens"] / q["all"]["prompt_tokens"])
    assert q["first"]["ttft_s"] is not None and later["ttft_s"] is not None and q["ttft_first_over_later"] > 0
    assert report["settings"]["questions_per_doc"] == K and report["settings"]["cache_prefix"] is True
    assert "| docs x K | declared | hit rate |" in (tmp_path / "stream.md").read_text()

    # the same documents again, through /generate: the first questions are new to the server all the same
    again = _run(server_url, docs_dir, tmp_path / "generate.json", "--endpoint", "generate")
    q = again["results"][0]["questions"]
    assert again["settings"]["run_id"] != report["settings"]["run_id"]
    assert q["first"]["cached_tokens"] == 0 and q["later"]["cached_tokens"] > 0
    assert q["hit_rate"] == pytest.approx((K - 1) / K, abs=1e-12)
    assert q["first"]["ttft_s"] is None  # /generate answers at once: latency only
    assert q["first"]["latency_s"] is not None


def test_without_the_declaration_nothing_is_restored(server_url: str, docs_dir: Path, tmp_path: Path) -> None:
    report = _run(server_url, docs_dir, tmp_path / "off.json", "--no-cache-prefix")
    q = report["results"][0]["questions"]
    assert not q["cache_prefix_declared"] and report["settings"]["cache_prefix"] is False
    assert q["saved_prefill_tokens"] == 0 and q["hit_rate"] == 0
    # each whole prompt was looked up (and missed): the questions differ
    assert q["server_queries_tokens"] == q["all"]["prompt_tokens"] > 0


def test_the_default_server_restores_undeclared_documents(default_url: str, docs_dir: Path,
                                                           tmp_path: Path) -> None:
    report = _run(default_url, docs_dir, tmp_path / "causal.json", "--no-cache-prefix")
    q = report["results"][0]["questions"]
    assert not q["cache_prefix_declared"] and q["first"]["cached_tokens"] == 0
    # each later question continues from the document's blocks kept by the first (whole 256-token blocks)
    later = q["later"]
    assert later["cached_tokens"] >= 2 * (K - 1) * 256 and later["cached_tokens"] % 256 == 0
    assert q["server_hits_tokens"]["memory"] == later["cached_tokens"]


def test_questions_sent_at_once_are_reported_and_continue_from_the_document(default_url: str, docs_dir: Path,
                                                                            tmp_path: Path) -> None:
    """`--questions-at-once`: a document's questions are sent together and reported as such; on the default
    server the later ones continue from the document's kept state, whether they came while the first was being
    read (they then wait for it: tests/service/engine/test_prefix_readers.py) or after."""
    out = tmp_path / "together.json"
    args = ["--url", default_url, "--docs", str(docs_dir), "--lengths", "2048", "--concurrency", "1",
            "--requests", str(2 * K), "--docs-per-length", "2", "--max-new-tokens", "2",
            "--questions-per-doc", str(K), "--questions-at-once", "--no-cache-prefix", "--out", str(out),
            "--markdown", str(out.with_suffix(".md")), "--strict", "--api-key", API_KEY]  # fmt: skip
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    q = row["questions"]
    assert row["ok"] == 2 * K and q["at_once"] and report["settings"]["questions_at_once"] is True
    assert q["first"]["cached_tokens"] == 0
    # every later question continued from the document's kept state: at least its first 1,792 tokens
    assert q["later"]["cached_tokens"] >= 2 * (K - 1) * 1792
    assert f"2 x {K} at once" in (tmp_path / "together.md").read_text()


@pytest.mark.parametrize("at_once", [False, True])
def test_a_documents_questions_go_one_after_the_other_or_all_at_once(at_once: bool) -> None:
    import asyncio

    from loadtest.client import Bound, RequestRecord
    from loadtest.questions import ask_documents

    in_flight, most, sent = [0], [0], []

    async def send(prompt: Document) -> RequestRecord:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        sent.append(prompt.text)
        await asyncio.sleep(0.01)
        in_flight[0] -= 1
        return RequestRecord(endpoint="stream", status=200, started_s=0.0, latency_s=0.01)

    docs = [Document("a.txt", "first document"), Document("b.txt", "second document")]
    records, _ = asyncio.run(ask_documents(send, docs, 4, 1, Bound(requests=2), lambda _: None, declare=False,
                                           tagger=Tagger("t"), at_once=at_once))
    assert most[0] == (4 if at_once else 1)  # one client: a document's questions together, or one by one
    assert sorted(r.question for r in records) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all("first document" in t for t in sent[:4]) and all("second document" in t for t in sent[4:])


def test_questions_differ_and_declare_the_tagged_document() -> None:
    questions = [question(i) for i in range(30)]
    assert len(set(questions)) == 30
    doc = Document("book.txt", "Rostóv said “naïve café”.\n")
    tagger = Tagger("abcd1234")
    prompts = conversation(doc, tagger.next(), 4, declare=True)
    head = "[loadtest abcd1234 document 0]\n\n" + doc.text
    for i, prompt in enumerate(prompts):
        assert prompt.cache_prefix_chars == len(head)  # characters, not bytes
        assert prompt.text == head + question(i)
    assert tagger.next() != "[loadtest abcd1234 document 0]\n\n"
    assert all(p.cache_prefix_chars is None for p in conversation(doc, "t", 2, declare=False))


@pytest.mark.parametrize("extra,message", [
    (["--questions-per-doc", "2", "--rate", "1"], "closed loop only"),
    (["--questions-per-doc", "2", "--endpoint", "all"], "use --endpoint generate or stream"),
    (["--questions-per-doc", "0"], "--questions-per-doc must be at least 1"),
    (["--no-cache-prefix"], "--no-cache-prefix needs --questions-per-doc"),
    (["--questions-at-once"], "--questions-at-once needs --questions-per-doc"),
])  # fmt: skip
def test_options_that_cannot_run_are_refused_by_name(
    docs_dir: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # no server listens on port 9: each refusal comes before any request
    assert cli.main(["--url", "http://127.0.0.1:9", "--docs", str(docs_dir), "--lengths", "256", *extra]) == 2
    assert message in " ".join(capsys.readouterr().err.split())  # rich wraps at the terminal's width
