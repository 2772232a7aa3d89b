"""The 13-gram held-out check (benchmarks/common/heldout_text.py) on small texts with a known overlap."""

from __future__ import annotations

from benchmarks.common import heldout_text as ht

WORDS = [f"w{i}" for i in range(40)]


def test_a_shared_passage_is_found_and_counted_once() -> None:
    used = {"old": [" ".join(WORDS[:20])]}  # 8 distinct 13-grams
    # the candidate quotes words 5..19 of the old text (3 of its 13-grams), in other case and punctuation
    quote = ", ".join(w.upper() for w in WORDS[5:20])
    candidate = {"new": ["fresh text " * 3 + quote + " and more fresh words here to end it"]}
    result = ht.check(candidate, used)
    whole = result["candidates"]["new"]["whole"]
    assert result["used"]["old"]["ngrams"] == 8
    assert whole["shared_with_any"] == 3 and whole["per_corpus"] == {"old": 3}
    assert whole["fraction"] == 3 / whole["ngrams"]


def test_unrelated_text_shares_nothing_and_ngrams_do_not_span_documents() -> None:
    used = {"old": [" ".join(WORDS[:13])]}
    # the same 13 words split over two documents make no 13-gram
    split = {"new": [" ".join(WORDS[:6]), " ".join(WORDS[6:13])]}
    assert ht.check(split, used)["candidates"]["new"]["whole"]["shared_with_any"] == 0
    assert ht.check({"same": [" ".join(WORDS[:13])]}, used)["candidates"]["same"]["whole"]["fraction"] == 1.0


def test_pod_markup_is_stripped_and_text_kept() -> None:
    pod = "=head1 NAME\n\nperlintro - a I<brief> intro to C<L<perlfunc>>\n\n=cut\n=begin html\n"
    text = ht.clean_pod(pod)
    assert "NAME" in text and "a brief intro to perlfunc" in text
    assert "=" not in text and "<" not in text


def test_test_split_is_the_last_tenth() -> None:
    assert ht.test_split(["a" * 90, "b" * 9]) == "\n" + "b" * 9
