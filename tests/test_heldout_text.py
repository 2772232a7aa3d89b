"""The 13-gram held-out check (benchmarks/common/heldout_text.py) on small texts with a known overlap."""

from __future__ import annotations

import pytest

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


def test_rst_markup_goes_and_prose_stays() -> None:
    rst = """.. SPDX-License-Identifier: GPL-2.0

.. _howto:

=====
Title
=====

The :c:func:`kmalloc` call and ``GFP_KERNEL`` flags, see `the docs <https://x.org>`_ and **bold** *words*.
An example follows::

    int x = kmalloc(8, GFP_KERNEL);

.. code-block:: c

    free(x);

.. note::
   Notes stay.

=====  =====
a      b
=====  =====

:Author: Someone
Back to prose.
"""
    text = ht.clean_rst(rst)
    assert "The kmalloc call and GFP_KERNEL flags, see the docs and bold words." in text
    assert "An example follows:" in text and "Notes stay." in text and "Author: Someone" in text
    assert "Back to prose." in text and "Title" in text
    for gone in ("SPDX", "_howto", "=====", "int x", "free(x)", "code-block", "::", "`", "*"):
        assert gone not in text, gone


def test_docbook_pages_lose_navigation_and_entities_are_decoded() -> None:
    page = (
        '<html><head><title>2.2. Concepts</title></head><body><div class="navheader"><table><tr><td>Prev</td>'
        '</tr></table></div><div class="sect1"><h2>2.2. Concepts</h2><p>A <code>table</code> is a set of'
        "   rows &amp; columns.</p><p>Second&nbsp;para.</p></div>"
        '<div class="navfooter"><table><tr><td>Next</td></tr></table></div></body></html>'
    )
    assert ht.docbook_text(page) == "2.2. Concepts\n\nA table is a set of rows & columns.\n\nSecond para.\n"


def test_the_gnu_fdl_appendix_is_cut_at_its_last_heading() -> None:
    heading = "Appendix A GNU Free Documentation License"
    text = f"Contents\n{heading}\n\nBody.\n{heading}\nGFDL"
    assert ht.strip_fdl_appendix(text) == f"Contents\n{heading}\n\nBody.\n"
    with pytest.raises(ValueError, match="no 'Appendix X GNU Free Documentation License'"):
        ht.strip_fdl_appendix("no appendix here")
