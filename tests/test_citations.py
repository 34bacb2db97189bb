"""Citations and the version: every registry id maps to BibTeX entries for the sources its
citation names, ``attnref cite`` prints valid BibTeX (a strict structural checker written here),
``attnref --version`` and ``attnref.__version__`` agree with the installed distribution and with
``CITATION.cff``."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

import attnref
from attnref import cli
from attnref.cli import citations

ROOT = Path(__file__).resolve().parents[1]

# What each source's registry citation text says of it (independent of the module's data): an
# entry is mapped to an id exactly when this text occurs in that id's ``Formulation.citation``.
MENTIONS = {
    "vaswani2017attention": "Vaswani",
    "elhage2021mathematical": "Elhage",
    "hidden_messages2025": "Hidden Messages of Multi-Head Attention",
    "reframing_attention2025": "Reframing Attention: A Matrix Decomposition Perspective",
    "refactoring_attention2025": "Refactoring the Attention Equations",
    "attention_all_you_need_to_know2025": "All you need to know",
    "attention_mechanism_concept2025": "[Concept] The Attention Mechanism",
    "karpathy2023cs25": "Karpathy",
    "milakov2018online": "Milakov",
    "dao2022flashattention": "FlashAttention: Fast and Memory-Efficient",
    "dao2023flashdecoding": "Flash-Decoding",
    "rabe2021selfattention": "Rabe",
    "ainslie2023gqa": "Ainslie",
    "shazeer2019fast": "Shazeer",
    "su2024roformer": "Su et al.",
    "katharopoulos2020transformers": "Katharopoulos",
    "choromanski2021performers": "Choromanski",
    "liu2023ring": "Liu",
    "brandon2023striped": "Brandon",
    "zhu2024ringflashattention": "ring-flash-attention",
    "jacobs2023ulysses": "Jacobs",
    "shoeybi2019megatron": "Shoeybi",
    "grattafiori2024llama3": "Grattafiori",
}

# The seed posts (../shared/seeds/README.md): title and date as each post gives them.
SEEDS = {
    "hidden_messages2025": ("The Hidden Messages of Multi-Head Attention", "2025-02-17"),
    "reframing_attention2025": (
        "Reframing Attention: A Matrix Decomposition Perspective",
        "2025-02-18",
    ),
    "refactoring_attention2025": (
        "Refactoring the Attention Equations: Patterns and Messages",
        "2025-02-19",
    ),
    "attention_all_you_need_to_know2025": ("Attention: All you need to know", "2025-03-29"),
    "attention_mechanism_concept2025": (
        "[Concept] The Attention Mechanism of Transformer Models",
        "2025-08-22",
    ),
}

# Required fields per entry type (BibTeX's standard styles); a tuple is "one of".
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "article": (("author",), ("title",), ("journal",), ("year",)),
    "inproceedings": (("author",), ("title",), ("booktitle",), ("year",)),
    "misc": (("title",), ("author", "howpublished"), ("year",)),
    "book": (("author", "editor"), ("title",), ("publisher",), ("year",)),
    "techreport": (("author",), ("title",), ("institution",), ("year",)),
}
HEAD = re.compile(r"@([a-z]+)\{([A-Za-z0-9_:.-]+),\n")
FIELD = re.compile(r"\s*([a-zA-Z]+)\s*=\s*\{")


def _braced(text: str, start: int) -> int:
    """Index just past the ``}`` closing the ``{`` at ``text[start]``; ValueError if unbalanced."""
    depth, escaped = 0, False
    for i in range(start, len(text)):
        if escaped:  # the character after a backslash (\{ or \}) does not count
            escaped = False
            continue
        escaped = text[i] == "\\"
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced braces from offset {start}")


def parse_bibtex(text: str) -> list[tuple[str, str, dict[str, str]]]:
    """Strictly parse BibTeX as this project writes it: entries ``@type{key,`` with one
    ``name = {value},`` per line and a closing ``}``, separated by blank lines only. Raises
    ValueError on anything else: unknown type, missing required field, duplicate field or key,
    unbalanced braces, stray text."""
    entries: list[tuple[str, str, dict[str, str]]] = []
    pos = 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        head = HEAD.match(text, pos)
        if head is None:
            raise ValueError(f"expected @type{{key, at offset {pos}: {text[pos : pos + 30]!r}")
        kind, key = head.groups()
        if kind not in REQUIRED:
            raise ValueError(f"{key}: unknown entry type {kind}")
        pos = head.end()
        fields: dict[str, str] = {}
        while True:
            if text.startswith("}", pos):
                pos += 1
                break
            m = FIELD.match(text, pos)
            if m is None:
                raise ValueError(f"{key}: expected a field at {text[pos : pos + 30]!r}")
            name = m.group(1).lower()
            end = _braced(text, m.end() - 1)
            if name in fields:
                raise ValueError(f"{key}: duplicate field {name}")
            fields[name] = text[m.end() : end - 1]
            if not text.startswith(",\n", end):
                raise ValueError(f"{key}: field {name} not followed by ',\\n'")
            pos = end + 2
        for options in REQUIRED[kind]:
            if not any(fields.get(o, "").strip() for o in options):
                raise ValueError(f"{key}: @{kind} needs {' or '.join(options)}")
        if not re.fullmatch(r"\d{4}", fields["year"]):
            raise ValueError(f"{key}: year {fields['year']!r}")
        if any(k == key for _, k, _ in entries):
            raise ValueError(f"duplicate key {key}")
        entries.append((kind, key, fields))
    return entries


def test_the_checker_rejects_broken_bibtex():
    good = "@misc{a,\n  title = {T},\n  howpublished = {H},\n  year = {2020},\n}\n"
    assert parse_bibtex(good) == [
        ("misc", "a", {"title": "T", "howpublished": "H", "year": "2020"})
    ]
    bad = [
        good.replace("{T}", "{T"),  # unbalanced
        good.replace("{T}", "{T\\}"),  # an escaped brace does not close
        good.replace("  year = {2020},\n", ""),  # misc without year
        good.replace("  howpublished = {H},\n", ""),  # neither author nor howpublished
        good.replace("@misc", "@article"),  # article without author/journal
        good.replace("@misc", "@mystery"),
        good + good,  # duplicate key
        good.replace("{H},", "{H}"),  # missing comma
        good + "stray",
    ]
    for text in bad:
        with pytest.raises(ValueError):
            parse_bibtex(text)


def test_every_registry_id_is_mapped():
    missing = sorted(set(attnref.ids()) - set(citations.SOURCES))
    assert not missing, f"registry ids without citation keys (add to SOURCES): {missing}"
    assert not set(citations.SOURCES) - set(attnref.ids()), "SOURCES maps ids not registered"
    for fid in attnref.ids():
        assert citations.SOURCES[fid], fid
        assert set(citations.SOURCES[fid]) <= set(citations.ENTRIES), fid


def test_every_entry_is_printed_for_some_id():
    """``attnref cite`` prints an entry only for the ids that map it: an entry no id maps is
    never printed."""
    mapped = {key for keys in citations.SOURCES.values() for key in keys}
    assert not set(citations.ENTRIES) - mapped, "entries no registry id cites"


def test_no_entry_has_a_note():
    """A ``note`` prints in a paper's bibliography; what the entries leave out is said in the
    module's comments instead."""
    for key, entry in citations.ENTRIES.items():
        assert "note" not in dict(entry.fields), key
    assert "note" not in dict(citations.attnref_entry().fields)


def test_mapping_matches_the_citation_text():
    """Each id maps exactly the sources its registry citation names."""
    assert set(MENTIONS) == set(citations.ENTRIES), "give each entry a mention here"
    for f in attnref.formulations():
        named = {k for k, text in MENTIONS.items() if text in f.citation}
        assert set(citations.SOURCES[f.id]) == named, f.id


def test_citation_text_gives_each_source_its_entrys_year():
    """One year per source: wherever a citation names a source and then a year in parentheses
    ("Su et al. (2024)", "Liu, Zaharia & Abbeel (2023)"), the year is its entry's."""
    for f in attnref.formulations():
        for key in citations.SOURCES[f.id]:
            year = dict(citations.ENTRIES[key].fields)["year"]
            pattern = re.escape(MENTIONS[key]) + r"[^()]{0,40}\((\d{4})\)"
            for found in re.findall(pattern, f.citation):
                assert found == year, (f.id, key, found, year)


def test_all_entries_parse_and_keys_are_unique():
    text = "\n\n".join(citations.bibtex(k, e) for k, e in citations.ENTRIES.items())
    text += "\n\n" + citations.bibtex(citations.ATTNREF_KEY, citations.attnref_entry())
    parsed = parse_bibtex(text)
    keys = [k for _, k, _ in parsed]
    assert len(keys) == len(set(keys)) == len(citations.ENTRIES) + 1


def test_arxiv_fields_agree_with_each_other():
    """An entry with an ``eprint`` has a well-formed arXiv id, its abstract page as ``url``, a
    category only in arXiv's form, and (a preprint) ``howpublished`` naming the same id."""
    with_eprint = 0
    for key, entry in citations.ENTRIES.items():
        fields = dict(entry.fields)
        if "eprint" not in fields:
            assert "archivePrefix" not in fields and "primaryClass" not in fields, key
            continue
        with_eprint += 1
        eprint = fields["eprint"]
        assert re.fullmatch(r"\d{4}\.\d{4,5}", eprint), key
        assert fields["archivePrefix"] == "arXiv", key
        assert fields["url"] == f"https://arxiv.org/abs/{eprint}", key
        assert re.fullmatch(r"cs\.[A-Z]{2}", fields.get("primaryClass", "cs.XX")), key
        if fields.get("howpublished", "").startswith("arXiv"):
            assert fields["howpublished"] == f"arXiv preprint arXiv:{eprint}", key
    assert with_eprint >= 14


def test_seed_posts_claim_no_more_than_they_name():
    """The blog posts name no author: their entries have none; title, year and month are the
    post's; an address is given only with the site it belongs to."""
    for key, (title, date) in SEEDS.items():
        fields = dict(citations.ENTRIES[key].fields)
        assert fields["title"] == title, key
        assert fields["howpublished"].startswith("Blog post"), key
        assert "author" not in fields, key
        year, month, _ = date.split("-")
        assert (fields["year"], fields["month"]) == (year, month.lstrip("0")), key
        if "url" in fields:
            site = fields["howpublished"].removeprefix("Blog post, ")
            assert fields["url"] == f"https://{site}", key


def test_keys_of_an_unmapped_id_raise():
    with pytest.raises(KeyError, match="no_such_id"):
        citations.keys("no_such_id")


def test_cite_bibtex_prints_valid_bibtex(capsys):
    assert cli.main(["cite", "patterns_messages", "--bibtex"]) == 0
    parsed = parse_bibtex(capsys.readouterr().out)
    keys = [k for _, k, _ in parsed]
    assert keys == [*citations.SOURCES["patterns_messages"], "attnref"]
    attnref_fields = parsed[-1][2]
    assert attnref_fields["version"] == attnref.__version__


def test_cite_plain_text(capsys):
    assert cli.main(["cite", "ring"]) == 0
    out = capsys.readouterr().out
    f = attnref.get("ring")
    assert f.title in out and f.citation in out
    assert f"version {attnref.__version__}" in out


def test_cite_unknown_id_is_a_one_line_error(capsys):
    """One line, as ``attnref --help`` promises (``tests/test_cli_usability.py`` checks the
    names ``cite`` takes besides ids)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["cite", "no_such_id"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnref cite: error:")
    assert "no_such_id" in err[0] and "attnref list" in err[0]


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnref {attnref.__version__}"


def test_version_is_the_installed_distributions():
    """pyproject.toml reads the version from attnref/__init__.py (hatchling), so the installed
    metadata agrees after ``pip install -e .``."""
    assert attnref.__version__ == importlib.metadata.version("attnref")
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[a-z0-9.+-]*)", attnref.__version__)


def test_citation_cff():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    for key in ("message", "title"):
        assert isinstance(cff[key], str) and cff[key].strip(), key
    authors = cff["authors"]
    assert isinstance(authors, list) and authors
    for a in authors:
        assert isinstance(a, dict) and ("name" in a or "family-names" in a), a
    assert isinstance(cff["version"], str) and cff["version"] == attnref.__version__
    assert cff["license"] == "Apache-2.0"


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
