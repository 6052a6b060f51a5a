"""REFORMER_PREFILL=causal through the service: a prompt read token by token as decode steps read tokens, its
state kept at its last 256-token block boundary, and every later prompt that starts with those tokens
continuing from it with no declaration. The answers are the cold answers bit for bit (the same text and the
same logprobs) whatever the cache held, on every route, and forks of identical prompts still share one read."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.prefix_cache.keys import KEY_BLOCK_TOKENS
from tests.service.helpers import metric_value, running_app

# byte tokenizer: one token per character; the document spans two whole blocks and part of a third
DOC = ("The harbour master kept a ledger of every ship that came in, its cargo, its crew and the weather. "
       "In the valley the river turned twice before it reached the mill. ") * 4
QUESTIONS = [" Who kept the ledger?", " Where did the river turn, and how often did it turn on its way?",
             " Name one ship."]
SETTINGS: dict[str, Any] = dict(prefill="causal", max_new_tokens=8, max_input_tokens=1024,
                                prefix_cache_min_tokens=16)


def _generate(client: TestClient, prompt: str, **params: Any) -> tuple[str, list[float], int]:
    parameters = {"max_new_tokens": 6, "details": True, "do_sample": True, "seed": 7, **params}
    r = client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert int(r.headers["x-cached-tokens"]) == details["cached_tokens"]
    return r.json()["generated_text"], [t["logprob"] for t in details["tokens"]], details["cached_tokens"]


@pytest.fixture(scope="module")
def cold(artifact: Any) -> list[tuple[str, list[float], int]]:
    """Each prompt alone on a causal server with the prefix cache off."""
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        return [_generate(off, DOC + q) for q in QUESTIONS]


def test_the_document_is_found_by_content_and_the_answers_are_the_cold_ones(artifact: Any, cold: Any) -> None:
    assert len(DOC) > 2 * KEY_BLOCK_TOKENS
    with running_app(artifact, **SETTINGS) as on:
        warm = [_generate(on, DOC + q) for q in QUESTIONS]
        again = _generate(on, DOC + QUESTIONS[1])
        metrics = on.get("/metrics").text
        info = on.get("/info").json()
    assert all(cached == 0 for _, _, cached in cold)
    # the first prompt keeps its last boundary short of its end; the others start with that much of it
    boundary = (len(DOC) // KEY_BLOCK_TOKENS) * KEY_BLOCK_TOKENS
    assert [c for _, _, c in warm] == [0, boundary, boundary]
    assert [(t, lp) for t, lp, _ in warm] == [(t, lp) for t, lp, _ in cold]  # bit for bit: equal floats
    assert again[:2] == cold[1][:2] and again[2] == (len(DOC + QUESTIONS[1]) - 1) // KEY_BLOCK_TOKENS \
        * KEY_BLOCK_TOKENS
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "memory"}) == \
        2 * boundary + again[2]
    assert info["batching"]["prefill"] == "causal"
    # the last request's blocks of the document stay in the decode cache for the next one to share
    assert info["prefix_cache"]["kept_prefixes"] is True
    assert info["prefix_cache"]["kept_prefix_bytes"] == \
        metric_value(metrics, "reformer_decode_cache_kept_prefix_bytes") > 0


def test_a_state_kept_past_the_document_serves_it_cut_back_to_a_shared_boundary(artifact: Any) -> None:
    """A first question long enough that its prompt's kept boundary lies inside the question: a second question
    continues from that state truncated to the document's last whole block (model/decoding/prefix_restore.py)."""
    long_question = " Tell me, in order and with every detail, " + "what each ship carried and who sailed it, " * 7
    first, second = DOC + long_question, DOC + QUESTIONS[2]
    kept = (len(first) - 1) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS
    shared = len(DOC) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS
    assert kept > len(DOC) > shared
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        cold = _generate(off, second)
    with running_app(artifact, **SETTINGS) as on:
        assert _generate(on, first)[2] == 0
        entries = on.get("/info").json()["prefix_cache"]["entries"]
        warm = _generate(on, second)
    assert entries == 1
    assert warm[:2] == cold[:2] and warm[2] == shared


def test_a_kept_state_and_its_tails_come_back_from_disk_after_a_restart(artifact: Any, tmp_path: Any) -> None:
    """The disk tier keeps a causal state with its block tails (authenticated, layout-checked): a restarted
    server continues the same prompt from it, and then a prompt sharing only an earlier boundary from it too."""
    long_question = " Tell me, in order and with every detail, " + "what each ship carried and who sailed it, " * 7
    first, second = DOC + long_question, DOC + QUESTIONS[2]
    kept = (len(first) - 1) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS
    disk = dict(SETTINGS, prefix_cache_dir=tmp_path, prefix_cache_key="k" * 32)
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        cold = [_generate(off, first), _generate(off, second)]
    with running_app(artifact, **disk) as before:
        assert _generate(before, first) == cold[0]
        before.app.state.service.engine.prefix_cache.flush()  # type: ignore[attr-defined]
    with running_app(artifact, **disk) as after:
        again = _generate(after, first)
        other = _generate(after, second)
        metrics = after.get("/metrics").text
    assert again[:2] == cold[0][:2] and again[2] == kept
    assert other[:2] == cold[1][:2] and other[2] == len(DOC) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "disk"}) == kept


def test_a_conversation_continues_from_its_previous_turn(artifact: Any) -> None:
    turn1 = DOC + " Who kept the ledger?"
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        first_cold = _generate(off, turn1)
        turn2 = turn1 + first_cold[0] + " And the mill?"
        second_cold = _generate(off, turn2)
    with running_app(artifact, **SETTINGS) as on:
        first = _generate(on, turn1)
        second = _generate(on, turn2)
    assert first == first_cold
    assert second[:2] == second_cold[:2]
    assert second[2] == (len(turn1) // KEY_BLOCK_TOKENS) * KEY_BLOCK_TOKENS


def test_a_declared_prefix_changes_nothing_under_the_causal_prefill(artifact: Any, cold: Any) -> None:
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        declared = _generate(off, DOC + QUESTIONS[0], cache_prefix_chars=len(DOC))
    assert declared == cold[0]


def test_choices_share_one_read_and_a_short_prompt_reads_alone(artifact: Any) -> None:
    with running_app(artifact, **SETTINGS) as on:
        r = on.post("/v1/completions", json={"prompt": DOC + QUESTIONS[0], "n": 3, "max_tokens": 4,
                                             "temperature": 1.0, "seed": 3})
        assert r.status_code == 200, r.text
        short = on.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}})
        assert short.status_code == 200, short.text
        metrics = on.get("/metrics").text
    assert len(r.json()["choices"]) == 3
    assert metric_value(metrics, "reformer_prefix_cache_forks_total") == 2
    assert short.json()["details"]["cached_tokens"] == 0


def test_a_scored_prompt_is_read_causally_whatever_the_cache_holds(artifact: Any) -> None:
    """A scored prompt is read by the causal extend from position 0 (tests/service/api/test_causal_scoring.py
    checks its scores against the decode steps): the same scores with a kept state of its prefix or none, not
    the one-piece forward's."""
    body = {"prompt": DOC, "echo": True, "logprobs": 1, "max_tokens": 0}
    with running_app(artifact, **SETTINGS) as on:
        _generate(on, DOC + QUESTIONS[0])  # keeps DOC's part
        assert _generate(on, DOC + QUESTIONS[1])[2] == len(DOC) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS  # it is kept
        r = on.post("/v1/completions", json=body)
    with running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        cold = off.post("/v1/completions", json=body)
    with running_app(artifact, **{**SETTINGS, "prefill": "one-piece"}) as one_piece:
        other = one_piece.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    scores = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(scores) == len(DOC)
    assert scores == cold.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert scores != other.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.fixture(scope="module")
def pair(artifact: Any) -> Any:
    """A causal server whose prefix cache holds about two states (so it evicts), and one without a cache."""
    with running_app(artifact, **SETTINGS) as probe:
        entry = probe.app.state.service.engine.runner.cache.bytes_for(3 * KEY_BLOCK_TOKENS)  # type: ignore[attr-defined]
    with running_app(artifact, **SETTINGS, prefix_cache_bytes=2 * entry) as on, \
            running_app(artifact, **SETTINGS, prefix_cache=False) as off:
        yield on, off


OTHER = DOC[::-1]  # a second document of the same length
REQUEST = st.tuples(st.sampled_from([DOC, OTHER]), st.integers(1, len(DOC)), st.sampled_from(QUESTIONS),
                    st.sampled_from([None, 3, 8]))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=2, max_size=5), st.booleans())
def test_any_requests_in_any_order_and_company_answer_as_with_the_cache_off(
        pair: Any, requests: list[Any], together: bool) -> None:
    """Prompts cut anywhere in one of two documents, greedy or seeded, sent one after another or all at once
    (read while others run), with evictions: every answer (text and logprobs) equals the cache-off server's
    answer to the same prompt alone."""
    on, off = pair

    def ask(client: TestClient, request: Any) -> tuple[str, list[float]]:
        doc, cut, question, seed = request
        params = {"do_sample": False} if seed is None else {"temperature": 0.8, "seed": seed}
        return _generate(client, doc[:cut] + question, **params)[:2]

    want = [ask(off, r) for r in requests]
    if together:
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(lambda r: ask(on, r), requests))
    else:
        got = [ask(on, r) for r in requests]
    assert got == want


def test_two_salts_never_continue_from_each_others_states(artifact: Any) -> None:
    with running_app(artifact, **SETTINGS) as on:
        _generate(on, DOC + QUESTIONS[0], cache_salt="tenant-a")
        other = on.post("/generate", json={"inputs": DOC + QUESTIONS[1], "parameters": {
            "max_new_tokens": 2, "details": True, "cache_salt": "tenant-b"}})
        same = on.post("/generate", json={"inputs": DOC + QUESTIONS[1], "parameters": {
            "max_new_tokens": 2, "details": True, "cache_salt": "tenant-a"}})
    assert other.json()["details"]["cached_tokens"] == 0
    assert same.json()["details"]["cached_tokens"] == len(DOC) // KEY_BLOCK_TOKENS * KEY_BLOCK_TOKENS


def test_tails_every_spacing_and_near_the_end() -> None:
    from service.engine.prompt_reuse import TAIL_NEAR_END, TAIL_SPACING, tail_boundaries

    keep = 3 * TAIL_SPACING + 5 * KEY_BLOCK_TOKENS
    got = tail_boundaries(keep)
    near = [keep - k * KEY_BLOCK_TOKENS for k in range(TAIL_NEAR_END - 1, -1, -1)]
    assert got == [TAIL_SPACING, 2 * TAIL_SPACING, 3 * TAIL_SPACING, *near]
    assert tail_boundaries(2 * KEY_BLOCK_TOKENS) == [KEY_BLOCK_TOKENS, 2 * KEY_BLOCK_TOKENS]


def test_a_prefix_ending_between_tails_continues_from_the_one_before(artifact: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With tails every 2 blocks and at the last one only, a prompt sharing 3 blocks of a kept 5-block state
    continues from 2 blocks, reads the rest, and answers the cold answer bit for bit."""
    import service.engine.prompt_reuse as prompt_reuse

    monkeypatch.setattr(prompt_reuse, "TAIL_SPACING", 2 * KEY_BLOCK_TOKENS)
    monkeypatch.setattr(prompt_reuse, "TAIL_NEAR_END", 1)
    doc = (DOC * 3)[: 5 * KEY_BLOCK_TOKENS + 40]
    other = doc[: 3 * KEY_BLOCK_TOKENS + 10] + " and then something else happened entirely." + QUESTIONS[0]
    settings_ = {**SETTINGS, "max_input_tokens": 2048}
    with running_app(artifact, **settings_, prefix_cache=False) as off:
        cold = _generate(off, other)
    with running_app(artifact, **settings_) as on:
        assert _generate(on, doc + QUESTIONS[1])[2] == 0  # kept at 5 blocks, tails at 2, 4 and 5
        warm = _generate(on, other)
    assert warm[:2] == cold[:2] and warm[2] == 2 * KEY_BLOCK_TOKENS


def test_with_a_disk_tier_the_key_chain_is_hashed_on_the_reader_thread(artifact: Any, tmp_path: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's key chain (about 12 ms for 500K tokens) is hashed once, off the event loop: on the prefix
    cache's reader thread, which looks for its state on disk, and the worker reuses it."""
    import threading

    from service.prefix_cache import PrefixCache

    threads: list[str] = []
    links = PrefixCache.links

    def spy(self: PrefixCache, tokens: Any, salt: str | None) -> list[tuple[int, str]]:
        threads.append(threading.current_thread().name)
        return links(self, tokens, salt)

    monkeypatch.setattr(PrefixCache, "links", spy)
    disk = dict(SETTINGS, prefix_cache_dir=tmp_path, prefix_cache_key="k" * 32)
    with running_app(artifact, **disk) as client:
        _generate(client, DOC + QUESTIONS[0])
        _generate(client, DOC + QUESTIONS[1])
    assert threads == ["prefix-cache-read"] * 2
