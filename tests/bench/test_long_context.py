"""bench/long_context.py's retrieval part: the scoring (passkey match, copy score, interval, summary), the
trials it builds, the three ways of asking (teacher-forced forward = greedy for an exact match, cached, the
service's reply read from its token ids), and a whole run on a tiny artifact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from bench import long_context
from bench.long_context import copy_score, make_trials, passkey_correct, summarize, wilson
from bench.long_context_ways import CachedWay, ForwardWay, ServiceWay
from tests.conftest import tiny_model
from train.long_docs import QUESTION


def test_passkey_is_correct_only_when_the_five_digits_match() -> None:
    assert passkey_correct(b"68432", b"68432")
    assert passkey_correct(b"68432. Remember", b"68432")  # what follows the key is not scored
    assert not passkey_correct(b"6843", b"68432") and not passkey_correct(b"68433", b"68432")
    assert not passkey_correct(b" 68432", b"68432")


def test_copy_score_is_the_share_of_bytes_matched_in_place() -> None:
    target = b"abcdefghij" * 8
    assert copy_score(target, target) == 1.0
    assert copy_score(b"", target) == 0.0
    assert copy_score(target[:40], target) == 0.5  # a short generation misses the rest
    assert copy_score(b"x" + target[1:], target) == pytest.approx(79 / 80)
    assert copy_score(target[1:] + b"j", target) < 0.2  # shifted by one: not a copy in place
    with pytest.raises(ValueError):
        copy_score(b"a", b"")


def test_wilson_interval_and_summary() -> None:
    lo, hi = wilson(0, 20)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0.15 < hi < 0.17
    lo, hi = wilson(20, 20)
    assert 0.83 < lo < 0.85 and hi == pytest.approx(1.0)
    assert all(math.isnan(v) for v in wilson(0, 0))
    recs = [{"length": 1024, "way": "cached", "kind": k, "score": s, "teacher": t, "seconds": 1.0}
            for k, s, t in (("passkey", 1.0, None), ("passkey", 0.0, None), ("passkey", 1.0, None),
                            ("passkey_standard", 1.0, None), ("copy", 0.5, 0.75), ("copy", 0.75, 1.0),
                            ("copy_control", 0.25, 0.5), ("copy_control", 0.25, 0.25))]
    recs.append({"length": 4096, "way": "service", "kind": "passkey", "score": 0.0, "teacher": None, "seconds": 2.0})
    rows = summarize(recs)
    assert [(r["length"], r["passkey_correct"], r["passkey_trials"]) for r in rows] == [(1024, 2, 3), (4096, 0, 1)]
    assert (rows[0]["passkey_standard_correct"], rows[0]["passkey_standard_trials"]) == (1, 1)
    assert rows[0]["copy_score"] == 0.625 and rows[0]["copy_control"] == 0.25
    assert rows[0]["copy_minus_control"] == 0.375 and rows[0]["seconds"] == 8.0
    assert rows[0]["copy_teacher"] == 0.875 and rows[0]["copy_teacher_control"] == 0.375
    assert rows[0]["copy_teacher_minus_control"] == 0.5
    assert rows[1]["copy_score"] is None and rows[1]["copy_teacher"] is None  # a way without copy trials
    table = long_context.retrieval_table(rows)
    assert "| 1,024 | cached | 2/3 | 1/1 | 0.625 | 0.250 | +0.375 | 0.875 | 0.375 |" in table
    assert "| 4,096 | service | 0/1 | 0/0 | - | - | - | - | - |" in table


POOL = ("It was the best of times, it was the worst of times, \u201cit was the age of wisdom\u201d. ".encode() * 200)


def test_trials_are_seeded_documents_of_the_stated_length() -> None:
    trials = make_trials(POOL, 1024, 3, seed=7)
    assert [t.kind for t in trials] == ["passkey", "passkey_standard", "copy", "copy_control"] * 3
    assert all(len(t.doc.data) == 1024 and len(t.doc.prompt) + len(t.doc.answer_bytes) == 1024 for t in trials)
    for t in trials:
        t.doc.prompt.decode("utf-8")  # the service takes text
    keys = [t.doc.answer_bytes for t in trials if t.kind.startswith("passkey")]
    assert all(t.doc.prompt.endswith(QUESTION) for t in trials if t.kind.startswith("passkey")) and len(set(keys)) == 6
    prose, standard = trials[0].doc, trials[1].doc
    assert b"The grass is green. The sky is blue." in standard.data and b"The grass is" not in prose.data
    assert b"best of times" in prose.data and b"best of times" not in standard.data
    copy, control = trials[2].doc, trials[3].doc
    assert len(copy.answer_bytes) == 80 and control.answer_bytes == copy.answer_bytes
    assert copy.data[:140] in copy.prompt[140:] + copy.answer_bytes
    assert control.data[140:] == copy.data[140:] and control.data[:140] != copy.data[:140]
    again = make_trials(POOL, 1024, 3, seed=7)
    assert [t.doc for t in again] == [t.doc for t in trials]
    assert make_trials(POOL, 1024, 3, seed=8)[0].doc != trials[0].doc


def test_teacher_forced_forward_agrees_with_greedy_and_cached_decoding() -> None:
    lm = tiny_model(seed=3)
    prompt = POOL[:300]
    greedy = ForwardWay(lm, "greedy").answer(prompt, b"?????")
    assert len(greedy) == 5
    # where greedy wrote the expected bytes, the teacher-forced argmax is those same bytes
    assert ForwardWay(lm, "teacher").answer(prompt, greedy) == greedy
    assert CachedWay(lm).answer(prompt, b"?????") == greedy


def test_cached_teacher_forcing_is_the_truncated_forward_at_every_byte() -> None:
    lm = tiny_model(seed=3)
    prompt, expected = POOL[:300], POOL[300:340]
    forced = CachedWay(lm).teacher(prompt, expected)
    with torch.no_grad():
        ids = [int(lm(torch.tensor([[b + 2 for b in prompt + expected[:j]]])).logits[0, -1].argmax())
               for j in range(len(expected))]
    want = bytes(i - 2 if i >= 2 else 0 for i in ids)  # a special id reads as NUL, as the ways write it
    assert forced == want and len(forced) == 40
    assert ForwardWay(lm, "greedy").teacher(prompt, expected) == ForwardWay(lm, "teacher").answer(prompt, expected)
    assert ServiceWay("http://x").teacher(prompt, expected) is None


def test_service_way_asks_greedy_and_reads_the_token_ids() -> None:
    seen: dict[str, object] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        tokens = [{"id": b + 2, "text": chr(b), "logprob": 0.0, "special": False} for b in b"68432"]
        return httpx.Response(200, json={"generated_text": "68432", "details": {
            "finish_reason": "length", "generated_tokens": 5, "prompt_tokens": 3, "seed": None, "tokens": tokens}})

    way = ServiceWay("http://x", client=httpx.Client(transport=httpx.MockTransport(handler)))
    assert way.answer("caf\u00e9 ".encode(), b"00000") == b"68432"
    assert seen["inputs"] == "caf\u00e9 "
    assert seen["parameters"] == {"max_new_tokens": 5, "do_sample": False, "details": True, "ignore_eos": True}


def test_retrieval_run_writes_rows_records_and_bits_per_byte(tiny_artifact: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    (data / "a.txt").write_text("".join(rng.choice(list("abcdefgh ij\n"), size=8000)))
    out = tmp_path / "r.json"
    assert long_context.main([str(tiny_artifact), "--retrieval", "--data", str(data), "--val-fraction", "0.5",
                              "--lengths", "512,600", "--trials", "2", "--ways", "forward,cached",
                              "--bpb-passages", "1536", "--max-passages", "1", "--threads", "1",
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["length"], r["way"]) for r in result["rows"]] == [
        (512, "forward (teacher)"), (600, "forward (teacher)"), (512, "cached"), (600, "cached")]
    assert len(result["records"]) == 2 * 2 * 4 * 2 and result["rows"][0]["passkey_trials"] == 2
    assert result["rows"][0]["passkey_standard_trials"] == 2 and result["rows"][2]["copy_teacher"] is not None
    assert all(r["teacher"] is None for r in result["records"] if r["kind"].startswith("passkey"))
    assert result["bits_per_byte"][0]["passage_bytes"] == 1536 and result["forward_mode"] == "teacher"


def test_prose_pool_is_ascii_so_every_cut_is_text() -> None:
    tails = [("a.txt", np.frombuffer("caf\u00e9 \u2014 ok".encode(), dtype=np.uint8).astype(np.int64) + 2)]
    pool = long_context.prose_pool(tails)
    assert pool == b"caf" + b" " * 7 + b"ok"  # the 2-byte and 3-byte characters: one space a byte
    for cut in range(len(pool) + 1):
        pool[:cut].decode("utf-8")  # never raises
