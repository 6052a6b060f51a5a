"""The prefix cache through the service: an answer never depends on what the cache held (empty, warm, evicted,
restored from disk, or off), hits are reported in responses and metrics, n choices share one prefill and equal
n requests of one choice, and a corrupt or foreign disk entry is refused by name while the request computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.helpers import metric_value, running_app

DOCS = [
    "The harbour master kept a ledger of every ship that came in, its cargo and its crew. " * 3,
    "In the valley the river turned twice before it reached the mill, where the miller's daughter waited. " * 3,
]
QUESTIONS = [" Who kept the ledger?", " What did the miller's daughter do?", " Name one ship."]
# the one-piece prefill's cache (whole prompts, declared prefixes); the causal one: test_causal_cache.py
LIMITS: dict[str, Any] = dict(prefill="one-piece", max_new_tokens=16, max_input_tokens=600, prefix_cache_min_tokens=16)
KEY = "k" * 32  # the disk tier's HMAC key the replicas of these tests share


def _generate(client: TestClient, text: str, chars: int | None = None, **params: Any) -> tuple[str, int]:
    parameters = {"max_new_tokens": 6, "details": True, **params}
    if chars is not None:
        parameters["cache_prefix_chars"] = chars
    r = client.post("/generate", json={"inputs": text, "parameters": parameters})
    assert r.status_code == 200, r.text
    body = r.json()
    assert int(r.headers["x-cached-tokens"]) == body["details"]["cached_tokens"]
    return body["generated_text"], body["details"]["cached_tokens"]


def _store_holds(client: TestClient) -> None:
    """The prefix cache's accounting holds; then the decode cache's free blocks and slots are overwritten with
    NaN, so that a restore that misses a tensor reads garbage instead of what the last request left there."""
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    if engine.prefix_cache is not None:
        engine.prefix_cache.flush()
        engine.prefix_cache.store.check()
    with engine._cond:  # the worker is idle between requests; the lock keeps it so
        decode = engine.runner.cache
        free = [b for b in range(1, decode.blocks) if decode.allocator.is_free[b]]
        rows = torch.tensor([b * decode.block_size + i for b in free for i in range(decode.block_size)],
                            dtype=torch.long)
        for pool in decode.block_pools:
            pool.index_fill_(0, rows, float("nan"))
        width = decode.ring.width
        for li, kv in enumerate(decode.kv):
            if decode.is_ring(li):
                for slot in decode._free_slots:
                    kv[slot * width:(slot + 1) * width] = float("nan")


def test_a_declared_prefix_is_reused_and_the_answer_is_what_a_cold_server_gives(artifact: Any) -> None:
    doc = DOCS[0]
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        cold = [_generate(off, doc + q, len(doc)) for q in QUESTIONS]
        assert all(cached == 0 for _, cached in cold)
    with running_app(artifact, **LIMITS) as on:
        warm = [_generate(on, doc + q, len(doc)) for q in QUESTIONS]
        completion = on.post("/v1/completions", json={"prompt": doc + QUESTIONS[0], "cache_prefix_chars": len(doc),
                                                     "max_tokens": 6, "temperature": 0}).json()
        metrics = on.get("/metrics").text
        info = on.get("/info").json()["prefix_cache"]
        _store_holds(on)
    assert [text for text, _ in warm] == [text for text, _ in cold]
    assert [cached for _, cached in warm] == [0, len(doc), len(doc)]  # bytes: one token per character
    assert completion["choices"][0]["text"] == cold[0][0]
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": len(doc)}
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "memory"}) == 3 * len(doc)
    assert metric_value(metrics, "reformer_prefix_cache_queries_tokens_total") == 4 * len(doc)
    assert info["enabled"] and info["entries"] >= 1 and info["capacity_bytes"] > 0


def test_a_repeated_prompt_is_a_whole_prompt_hit_with_the_same_sampled_tokens(artifact: Any) -> None:
    prompt = DOCS[1] + QUESTIONS[0]
    params = {"do_sample": True, "temperature": 0.9, "seed": 11}
    with running_app(artifact, **LIMITS) as client:
        first = _generate(client, prompt, **params)
        second = _generate(client, prompt, **params)
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0.9, "seed": 11})
        _store_holds(client)
    assert first[1] == 0 and second[1] == len(prompt)
    assert first[0] == second[0]
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt)}


def test_n_choices_share_one_prefill_and_equal_n_requests_of_one(artifact: Any) -> None:
    prompt = DOCS[0][:150] + QUESTIONS[2]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 4}
    with running_app(artifact, **LIMITS, prefix_cache=False) as client:
        many = client.post("/v1/completions", json=body).json()
        metrics = client.get("/metrics").text
        alone = [client.post("/v1/completions", json={**body, "n": 1, "seed": seed}).json()["choices"][0]["text"]
                 for seed in many["seeds"]]
    assert [c["text"] for c in many["choices"]] == alone
    assert len(set(alone)) > 1  # each choice its own seed
    # three of the four copied the first one's prefill
    assert metric_value(metrics, "reformer_prefix_cache_forks_total") == 3
    assert many["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the first choice prefilled


def test_the_disk_tier_serves_a_restarted_server_and_refuses_a_corrupt_file(artifact: Any, tmp_path: Path) -> None:
    doc = DOCS[1]
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        want = _generate(off, doc + QUESTIONS[1], len(doc))[0]
    settings_ = dict(LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY)
    with running_app(artifact, **settings_) as first:
        assert _generate(first, doc + QUESTIONS[1], len(doc)) == (want, 0)
        _store_holds(first)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    with running_app(artifact, **settings_) as restarted:
        assert _generate(restarted, doc + QUESTIONS[1], len(doc)) == (want, len(doc))
        metrics = restarted.get("/metrics").text
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "disk"}) == len(doc)
    assert metric_value(metrics, "reformer_prefix_cache_disk_reads_total") == 1
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the last tensor's bytes
    files[0].write_bytes(bytes(data))
    with running_app(artifact, **settings_) as again:
        assert _generate(again, doc + QUESTIONS[1], len(doc)) == (want, 0)
        metrics = again.get("/metrics").text
        _store_holds(again)
    assert metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": "unauthenticated"}) == 1
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # rewritten by the request that computed


def test_a_file_of_another_artifact_is_refused_by_name(artifact: Any, tmp_path: Path) -> None:
    from service.prefix_cache.disk import DiskTier, EntryFault
    from service.prefix_cache.entry_key import EntryKey

    doc = DOCS[0]
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY) as client:
        _generate(client, doc + QUESTIONS[0], len(doc))
        _store_holds(client)
    (path,) = tmp_path.glob("*.safetensors")
    foreign = DiskTier(tmp_path, 2**30, "0" * 64, EntryKey(KEY.encode(), "setting"))
    with pytest.raises(EntryFault, match=f"{path.name} was written for another artifact") as refused:
        foreign.read(path.name.removesuffix(".safetensors"), lambda metadata, shapes: None)
    assert refused.value.reason == "foreign"
    assert not path.exists()


def test_without_a_key_a_restarted_server_refuses_the_files_of_the_last(artifact: Any, tmp_path: Path) -> None:
    """No REFORMER_PREFIX_CACHE_KEY: each process authenticates with a key of its own, so a file written by
    another process (a planted one, or the last run's) is refused as unauthenticated, deleted and rewritten."""
    doc = DOCS[0]
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path) as first:
        want = _generate(first, doc + QUESTIONS[0], len(doc))
        assert first.get("/info").json()["prefix_cache"]["disk_key"] == "per-process"
        _store_holds(first)
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path) as second:
        again = _generate(second, doc + QUESTIONS[0], len(doc))
        repeat = _generate(second, doc + QUESTIONS[0], len(doc))
        metrics = second.get("/metrics").text
    assert want[1] == 0 and again == want  # refused: computed again
    assert repeat == (want[0], len(doc))  # its own state, from memory
    assert metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": "unauthenticated"}) == 1


@pytest.mark.parametrize("body,param", [
    ({"inputs": "abc", "parameters": {"cache_prefix_chars": 4}}, "parameters.cache_prefix_chars"),
    ({"inputs": "abc", "parameters": {"cache_prefix_chars": 2, "truncate": 2}}, "parameters.cache_prefix_chars"),
    ({"inputs": "abc", "parameters": {"cache_prefix_chars": 0}}, "cache_prefix_chars"),
])
def test_a_bad_cache_prefix_is_refused_by_name(artifact: Any, body: dict[str, Any], param: str) -> None:
    with running_app(artifact, **LIMITS) as client:
        r = client.post("/generate", json=body)
    assert 400 <= r.status_code < 500
    assert param in r.text


def test_completions_refuse_a_cache_prefix_on_token_prompts(artifact: Any) -> None:
    with running_app(artifact, **LIMITS) as client:
        r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "cache_prefix_chars": 2, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_prefix_chars"


@pytest.fixture(scope="module")
def pair(artifact: Any) -> Any:
    """A server with a prefix cache small enough to evict, and one without a cache."""
    with running_app(artifact, **LIMITS, prefix_cache_bytes=400_000) as on, \
            running_app(artifact, **LIMITS, prefix_cache=False) as off:
        yield on, off


REQUEST = st.tuples(st.sampled_from(range(len(DOCS))), st.integers(40, len(DOCS[0]) - 1),
                    st.sampled_from(QUESTIONS), st.booleans(), st.sampled_from([None, 3, 8]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=2, max_size=5))
def test_any_sequence_of_requests_answers_as_with_the_cache_off(pair: Any, requests: list[Any]) -> None:
    """Shared and partly shared prefixes, declared or whole-prompt, greedy or seeded, with evictions (the
    cache holds a few entries): every answer equals the cache-off server's, and the cache's byte accounting
    (referenced + evictable + free = capacity) holds after every request."""
    on, off = pair
    for doc, cut, question, declare, seed in requests:
        text = DOCS[doc][:cut] + question
        chars = cut if declare else None
        params = {} if seed is None else {"do_sample": True, "temperature": 0.8, "seed": seed}
        assert _generate(on, text, chars, **params)[0] == _generate(off, text, chars, **params)[0]
        _store_holds(on)


def test_a_full_prefix_cache_evicts_and_never_fails_a_request_that_fits(artifact: Any) -> None:
    """The decode cache holds one request at a time and the prefix cache about one document's state: every
    request still runs (states are copied out of the decode cache, never held in its blocks), the memory tier
    evicts its least recently used entry, and the answers stay the cache-off ones."""
    tight = dict(LIMITS, max_batch_size=1, cache_bytes=2_000_000)
    prompts = [(DOCS[i % 2][: 200 + 13 * i] + QUESTIONS[i % 3], 200 + 13 * i) for i in range(4)]
    with running_app(artifact, **tight, prefix_cache=False) as off:
        want = [_generate(off, text, chars)[0] for text, chars in prompts]
    with running_app(artifact, **tight) as on:
        entry = on.app.state.service.engine.runner.cache.bytes_for(300)  # type: ignore[attr-defined]
    with running_app(artifact, **tight, prefix_cache_bytes=entry) as on:
        got = [_generate(on, text, chars)[0] for text, chars in prompts]
        metrics = on.get("/metrics").text
        _store_holds(on)
    assert got == want
    assert metric_value(metrics, "reformer_prefix_cache_evictions_total") >= 2


def test_a_chat_keeps_its_first_messages_cached_across_turns(artifact: Any) -> None:
    import dataclasses

    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    system = {"role": "system", "content": DOCS[0]}
    turns = [[system, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    turns.append([system, {"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": " ok."},
                  {"role": "user", "content": QUESTIONS[2]}])
    chat = dataclasses.replace(artifact, chat_template=template)
    answers = {}
    for name, extra in (("off", {"prefix_cache": False}), ("on", {})):
        with running_app(chat, **LIMITS, **extra) as client:
            replies = [client.post("/v1/chat/completions", json={
                "messages": m, "max_tokens": 5, "temperature": 0, "cache_prefix_messages": 1}).json() for m in turns]
            bad = client.post("/v1/chat/completions", json={"messages": turns[0], "cache_prefix_messages": 3})
        answers[name] = [r["choices"][0]["message"]["content"] for r in replies]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prefix_messages"
    assert answers["on"] == answers["off"]
    head = len(f"[system] {DOCS[0]}\n")
    assert cached == [0, head, head]


def test_a_kept_state_that_cannot_be_restored_is_computed_instead(artifact: Any) -> None:
    prompt = DOCS[0] + QUESTIONS[1]
    with running_app(artifact, **LIMITS) as client:
        first = _generate(client, prompt)
        store = client.app.state.service.engine.prefix_cache.store  # type: ignore[attr-defined]
        (key,) = list(store._entries)
        del store.get(key).tensors["kv.1"]  # a state missing a layer's keys and values
        second = _generate(client, prompt)
        third = _generate(client, prompt)
        _store_holds(client)
    assert first[1] == 0 and second == (first[0], 0)
    assert third == (first[0], len(prompt))  # the recomputed state was kept again


def test_a_leader_that_finishes_at_its_first_token_still_shares_its_state(artifact: Any) -> None:
    """n=3 choices of one token each: every choice ends at its first token, before the leader's state is
    copied (copies are made after the first tokens go out); the state is kept all the same, its blocks are
    freed after, and a later request restores it."""
    prompt = DOCS[1][:200] + QUESTIONS[0]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 1.0, "seed": 3, "n": 3}
    with running_app(artifact, **LIMITS, prefix_cache=False) as off:
        want = off.post("/v1/completions", json={**body, "max_tokens": 4, "n": 1, "temperature": 0}).json()
    with running_app(artifact, **LIMITS) as on:
        first = on.post("/v1/completions", json=body).json()
        later = on.post("/v1/completions", json={**body, "max_tokens": 4, "n": 1, "temperature": 0}).json()
        metrics = on.get("/metrics").text
        _store_holds(on)
        engine = on.app.state.service.engine  # type: ignore[attr-defined]
        assert engine.runner.stats()["cache_bytes"] == 0  # every state freed, the held leader's too
    assert len(first["choices"]) == 3
    assert metric_value(metrics, "reformer_prefix_cache_forks_total") == 2
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    assert later["choices"][0]["text"] == want["choices"][0]["text"]


def _written_at(path: Path) -> float:
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return float(json.loads(data[8:8 + n])["__metadata__"]["written_at"])


def test_a_state_that_fails_to_restore_leaves_both_tiers_and_is_not_counted_a_hit(artifact: Any,
                                                                                  tmp_path: Path) -> None:
    """A kept state that cannot be restored is dropped from memory and its file deleted (it is not read again),
    counted as a `restore` refusal and not as a hit; the request computes, and its state is kept again."""
    prompt = DOCS[1] + QUESTIONS[2]
    with running_app(artifact, **LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY) as client:
        first = _generate(client, prompt)
        cache = client.app.state.service.engine.prefix_cache  # type: ignore[attr-defined]
        cache.flush()
        (key,) = list(cache.store._entries)
        written = _written_at(cache.disk.path(key))
        del cache.store.get(key).tensors["kv.1"]
        second = _generate(client, prompt)
        metrics = client.get("/metrics").text
        cache.flush()
        rewritten = _written_at(cache.disk.path(key)) > written  # deleted, then written anew
        _store_holds(client)
    assert second == (first[0], 0)
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "memory"}) == 0
    assert metric_value(metrics, "reformer_prefix_cache_disk_refusals_total", {"reason": "restore"}) == 1
    assert rewritten  # the recomputed state was written again after the bad one was deleted


def test_disk_reads_run_off_the_model_workers_thread(artifact: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted server's hit from disk: the file is read on the prefix cache's reader thread while the
    request waits in the queue, never on the model worker's (where a slow volume would stall every step)."""
    import threading

    from service.prefix_cache.disk import DiskTier

    doc = DOCS[0]
    settings_ = dict(LIMITS, prefix_cache_dir=tmp_path, prefix_cache_key=KEY)
    with running_app(artifact, **settings_) as first:
        want = _generate(first, doc + QUESTIONS[2], len(doc))
        _store_holds(first)
    threads: list[str] = []
    real_read = DiskTier.read

    def read(self: DiskTier, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_read(self, *args)

    monkeypatch.setattr(DiskTier, "read", read)
    with running_app(artifact, **settings_) as restarted:
        assert _generate(restarted, doc + QUESTIONS[2], len(doc)) == (want[0], len(doc))
        metrics = restarted.get("/metrics").text
    assert metric_value(metrics, "reformer_prefix_cache_hits_tokens_total", {"tier": "disk"}) == len(doc)
    assert threads and set(threads) == {"prefix-cache-read"}
