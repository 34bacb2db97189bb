"""Citations as data: a BibTeX entry for every source the registry cites, and the map from each
registry id to the keys of its sources.

``ENTRIES`` holds the sources (key -> :class:`Entry`); ``SOURCES`` maps every registry id to
the keys of the sources its ``Formulation.citation`` names (``tests/test_citations.py`` fails
for an id without one, and for a source named in the text but not mapped). attnref's own entry
takes its version from ``attnref.__version__``.

Each entry was checked against a source: the paper's arXiv listing or its authors' repository
(the BibTeX in its README), or, for a field no primary source at hand showed, a reference list
that cites it; ``primaryClass`` is given only where the arXiv category was seen. A paper that has
been published is cited as published (venue, year, pages, DOI), with its arXiv id kept; the year
is the published one, and the prose uses the same year and the same first author. Every entry is
cited by at least one registry id (``tests/test_citations.py``), and no entry carries a ``note``:
a bibliography would print it. The seed posts (``../shared/seeds``) are cited with only what
each post names of itself (the comments at their entries).
"""

from __future__ import annotations

from dataclasses import dataclass

ATTNREF_KEY = "attnref"


@dataclass(frozen=True)
class Entry:
    """One BibTeX entry.

    Attributes:
        kind: The entry type (``article``, ``inproceedings``, ``misc``).
        fields: ``(name, value)`` pairs in output order; values are BibTeX text (braces kept).
    """

    kind: str
    fields: tuple[tuple[str, str], ...]


def _entry(kind: str, arxiv: tuple[str, str | None] | None = None, /, **fields: str) -> Entry:
    """``fields`` in the order given, then the arXiv fields of ``arxiv`` = ``(eprint,
    primaryClass)``, the category ``None`` where it was not checked."""
    if arxiv is not None:
        eprint, primary = arxiv
        fields |= {"eprint": eprint, "archivePrefix": "arXiv"}
        fields |= {"primaryClass": primary} if primary else {}
        fields["url"] = f"https://arxiv.org/abs/{eprint}"
    return Entry(kind, tuple(fields.items()))


def _preprint(author: str, title: str, year: str, eprint: str, primary: str | None) -> Entry:
    how = f"arXiv preprint arXiv:{eprint}"
    return _entry(
        "misc", (eprint, primary), author=author, title=title, howpublished=how, year=year
    )


def _seed(title: str, date: str, site: str = "", url: str = "") -> Entry:
    """A seed post: its title, and the year and month of its ``date`` (``YYYY-MM-DD``); the site
    and address only where the post names them. No author: none of the posts names one."""
    year, month, _ = date.split("-")
    where = f"Blog post, {site}" if site else "Blog post"
    address = {"url": url} if url else {}
    return _entry(
        "misc", title=title, howpublished=where, year=year, month=month.lstrip("0"), **address
    )


ENTRIES: dict[str, Entry] = {
    "vaswani2017attention": _entry(
        "inproceedings",
        ("1706.03762", "cs.CL"),
        author="Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and "
        "Jones, Llion and Gomez, Aidan N. and Kaiser, {\\L}ukasz and Polosukhin, Illia",
        title="Attention Is All You Need",
        booktitle="Advances in Neural Information Processing Systems",
        volume="30",
        publisher="Curran Associates, Inc.",
        year="2017",
    ),
    "elhage2021mathematical": _entry(
        "article",
        author="Elhage, Nelson and Nanda, Neel and Olsson, Catherine and Henighan, Tom and "
        "Joseph, Nicholas and Mann, Ben and Askell, Amanda and Bai, Yuntao and Chen, Anna "
        "and Conerly, Tom and DasSarma, Nova and Drain, Dawn and Ganguli, Deep and "
        "Hatfield-Dodds, Zac and Hernandez, Danny and Jones, Andy and Kernion, Jackson "
        "and Lovitt, Liane and Ndousse, Kamal and Amodei, Dario and Brown, Tom and Clark, "
        "Jack and Kaplan, Jared and McCandlish, Sam and Olah, Chris",
        title="A Mathematical Framework for Transformer Circuits",
        journal="Transformer Circuits Thread",
        year="2021",
        url="https://transformer-circuits.pub/2021/framework/index.html",
    ),
    # The seed posts (../shared/seeds), each read for what it names of itself. None names its
    # author. All but "Attention: All you need to know" name no site and no address of their own
    # (cited by title and date); that one names its site, far.in.net, the address given.
    "hidden_messages2025": _seed("The Hidden Messages of Multi-Head Attention", "2025-02-17"),
    # Its one link is to a video by its author, not to the post.
    "reframing_attention2025": _seed(
        "Reframing Attention: A Matrix Decomposition Perspective", "2025-02-18"
    ),
    "refactoring_attention2025": _seed(
        "Refactoring the Attention Equations: Patterns and Messages", "2025-02-19"
    ),
    "attention_all_you_need_to_know2025": _seed(
        "Attention: All you need to know", "2025-03-29", site="far.in.net", url="https://far.in.net"
    ),
    # The address it gives (learnopencv.com/attention-mechanism-in-transformer-neural-networks/)
    # is its source, not the post.
    "attention_mechanism_concept2025": _seed(
        "[Concept] The Attention Mechanism of Transformer Models", "2025-08-22"
    ),
    "karpathy2023cs25": _entry(
        "misc",
        author="Karpathy, Andrej",
        title="Introduction to Transformers",
        howpublished="Lecture, Stanford {CS25}: Transformers United {V2}, Stanford Online "
        "(YouTube)",
        year="2023",
    ),
    "milakov2018online": _preprint(
        "Milakov, Maxim and Gimelshein, Natalia",
        "Online normalizer calculation for softmax",
        "2018",
        "1805.02867",
        "cs.PF",
    ),
    "dao2022flashattention": _entry(
        "inproceedings",
        ("2205.14135", "cs.LG"),
        author="Dao, Tri and Fu, Daniel Y. and Ermon, Stefano and Rudra, Atri and "
        "R{\\'e}, Christopher",
        title="{FlashAttention}: Fast and Memory-Efficient Exact Attention with {IO}-Awareness",
        booktitle="Advances in Neural Information Processing Systems (NeurIPS)",
        year="2022",
    ),
    "dao2023flashdecoding": _entry(
        "misc",
        author="Dao, Tri and Haziza, Daniel and Massa, Francisco and Sizov, Grigory",
        title="{Flash-Decoding} for long-context inference",
        howpublished="PyTorch and Stanford {CRFM} blog posts",
        year="2023",
        month="10",
        url="https://crfm.stanford.edu/2023/10/12/flashdecoding.html",
    ),
    "rabe2021selfattention": _preprint(
        "Rabe, Markus N. and Staats, Charles",
        "Self-attention Does Not Need {$O(n^2)$} Memory",
        "2021",
        "2112.05682",
        "cs.LG",
    ),
    "ainslie2023gqa": _entry(
        "inproceedings",
        ("2305.13245", "cs.CL"),
        author="Ainslie, Joshua and Lee-Thorp, James and de Jong, Michiel and Zemlyanskiy, Yury "
        "and Lebr{\\'o}n, Federico and Sanghai, Sumit",
        title="{GQA}: Training Generalized Multi-Query Transformer Models from Multi-Head "
        "Checkpoints",
        booktitle="Proceedings of the 2023 Conference on Empirical Methods in Natural Language "
        "Processing (EMNLP)",
        pages="4895--4901",
        publisher="Association for Computational Linguistics",
        year="2023",
        doi="10.18653/v1/2023.emnlp-main.298",
    ),
    "shazeer2019fast": _preprint(
        "Shazeer, Noam",
        "Fast Transformer Decoding: One Write-Head is All You Need",
        "2019",
        "1911.02150",
        "cs.NE",
    ),
    # The journal version (Neurocomputing 568, 2024; arXiv:2104.09864 is the preprint, 2021).
    # Its record lists the authors in this order and form (arXiv: Su, Lu, Pan, Ahmed Murtadha,
    # Bo Wen, Liu), as the reference lists that cite its DOI print them.
    "su2024roformer": _entry(
        "article",
        ("2104.09864", "cs.CL"),
        author="Su, Jianlin and Ahmed, Murtadha and Lu, Yu and Pan, Shengfeng and Bo, Wen and "
        "Liu, Yunfeng",
        title="{RoFormer}: Enhanced Transformer with Rotary Position Embedding",
        journal="Neurocomputing",
        volume="568",
        pages="127063",
        year="2024",
        doi="10.1016/j.neucom.2023.127063",
    ),
    "katharopoulos2020transformers": _entry(
        "inproceedings",
        ("2006.16236", "cs.LG"),
        author="Katharopoulos, Angelos and Vyas, Apoorv and Pappas, Nikolaos and "
        "Fleuret, Fran{\\c{c}}ois",
        title="Transformers are {RNNs}: Fast Autoregressive Transformers with Linear Attention",
        booktitle="Proceedings of the 37th International Conference on Machine Learning",
        series="Proceedings of Machine Learning Research",
        volume="119",
        pages="5156--5165",
        year="2020",
    ),
    "choromanski2021performers": _entry(
        "inproceedings",
        ("2009.14794", "cs.LG"),
        author="Choromanski, Krzysztof and Likhosherstov, Valerii and Dohan, David and Song, "
        "Xingyou and Gane, Andreea and Sarlos, Tamas and Hawkins, Peter and Davis, Jared "
        "and Mohiuddin, Afroz and Kaiser, Lukasz and Belanger, David and Colwell, Lucy "
        "and Weller, Adrian",
        title="Rethinking Attention with Performers",
        booktitle="International Conference on Learning Representations (ICLR)",
        year="2021",
    ),
    "liu2023ring": _preprint(
        "Liu, Hao and Zaharia, Matei and Abbeel, Pieter",
        "Ring Attention with Blockwise Transformers for Near-Infinite Context",
        "2023",
        "2310.01889",
        "cs.CL",
    ),
    "brandon2023striped": _preprint(
        "Brandon, William and Nrusimha, Aniruddha and Qian, Kevin and Ankner, Zachary and "
        "Jin, Tian and Song, Zhiye and Ragan-Kelley, Jonathan",
        "Striped Attention: Faster Ring Attention for Causal Transformers",
        "2023",
        "2311.09431",
        None,
    ),
    "zhu2024ringflashattention": _entry(
        "misc",
        author="Zhu, Zilin",
        title="ring-flash-attention",
        howpublished="GitHub repository zhuzilin/ring-flash-attention",
        year="2024",
        url="https://github.com/zhuzilin/ring-flash-attention",
    ),
    "jacobs2023ulysses": _preprint(
        "Jacobs, Sam Ade and Tanaka, Masahiro and Zhang, Chengming and Zhang, Minjia and "
        "Song, Shuaiwen Leon and Rajbhandari, Samyam and He, Yuxiong",
        "{DeepSpeed Ulysses}: System Optimizations for Enabling Training of Extreme Long "
        "Sequence Transformer Models",
        "2023",
        "2309.14509",
        "cs.LG",
    ),
    "shoeybi2019megatron": _preprint(
        "Shoeybi, Mohammad and Patwary, Mostofa and Puri, Raul and LeGresley, Patrick and "
        "Casper, Jared and Catanzaro, Bryan",
        "{Megatron-LM}: Training Multi-Billion Parameter Language Models Using Model Parallelism",
        "2019",
        "1909.08053",
        "cs.CL",
    ),
    # Llama Team, AI @ Meta. The current arXiv version lists Aaron Grattafiori first (the first
    # versions list Abhimanyu Dubey first): "Grattafiori et al." in a bibliography and here.
    "grattafiori2024llama3": _preprint(
        "Grattafiori, Aaron and Dubey, Abhimanyu and others",
        "The {Llama} 3 Herd of Models",
        "2024",
        "2407.21783",
        "cs.AI",
    ),
}

_BLOCKWISE = ("milakov2018online", "dao2022flashattention", "ainslie2023gqa", "shazeer2019fast")
_SEEDS_MESSAGES = ("refactoring_attention2025", "reframing_attention2025")
_LINEAR = ("katharopoulos2020transformers",)

# Registry id -> the keys of the sources its ``citation`` names, in the order it names them.
SOURCES: dict[str, tuple[str, ...]] = {
    "concat": ("vaswani2017attention",),
    "per_head_sum": ("vaswani2017attention", "hidden_messages2025", *_SEEDS_MESSAGES),
    "scores_messages": ("hidden_messages2025", *_SEEDS_MESSAGES),
    "patterns_messages": _SEEDS_MESSAGES,
    "column": ("attention_all_you_need_to_know2025", "elhage2021mathematical"),
    "soft_search": ("refactoring_attention2025", "attention_all_you_need_to_know2025"),
    "graph": (
        "karpathy2023cs25",
        "attention_all_you_need_to_know2025",
        "attention_mechanism_concept2025",
    ),
    "linear_quadratic": (*_LINEAR, "choromanski2021performers"),
    "linear_associative": _LINEAR,
    "linear_prefix_sum": _LINEAR,
    "linear_recurrent": _LINEAR,
    "linear_chunked": _LINEAR,
    "linear_messages": (*_LINEAR, *_SEEDS_MESSAGES),
    "blockwise": _BLOCKWISE,
    "kv_cache": ("shazeer2019fast", "ainslie2023gqa"),
    "split_kv": ("dao2023flashdecoding", *_BLOCKWISE),
    "state_merge": ("milakov2018online", "rabe2021selfattention"),
    "rope": ("su2024roformer",),
    "rope_patterns": ("su2024roformer", *_SEEDS_MESSAGES),
    "ring": ("liu2023ring",),
    "striped": ("brandon2023striped", "liu2023ring"),
    "zigzag": ("zhu2024ringflashattention", "liu2023ring"),
    "all_gather": ("grattafiori2024llama3",),
    "ulysses": ("jacobs2023ulysses",),
    "tensor_parallel": ("shoeybi2019megatron",),
}

# attnref's first commit is dated 2026-11-22.
_ATTNREF_YEAR = "2026"
_ATTNREF_TITLE = (
    "attnref: every equivalent formulation of multi-head attention, a float64 oracle, and "
    "property tests that prove they agree"
)


def attnref_entry() -> Entry:
    """attnref's own entry, its version ``attnref.__version__``."""
    from attnref import __version__

    return _entry(
        "misc",
        author="{attnref developers}",
        title="{attnref}: " + _ATTNREF_TITLE.split(": ", 1)[1],
        howpublished=f"Python package, version {__version__}",
        year=_ATTNREF_YEAR,
        version=__version__,
    )


def attnref_text() -> str:
    """attnref's citation as one line of plain text."""
    from attnref import __version__

    return f"attnref developers ({_ATTNREF_YEAR}), {_ATTNREF_TITLE}, version {__version__}."


def bibtex(key: str, entry: Entry) -> str:
    """``entry`` as BibTeX under ``key``: ``@kind{key,``, a ``name = {value},`` line per field,
    ``}``."""
    width = max(len(name) for name, _ in entry.fields)
    lines = [f"  {name:<{width}} = {{{value}}}," for name, value in entry.fields]
    return f"@{entry.kind}{{{key},\n" + "\n".join(lines) + "\n}"


def keys(fid: str) -> tuple[str, ...]:
    """The keys of :data:`SOURCES` ``[fid]`` (registry id ``fid``), then ``"attnref"``;
    ``KeyError`` if ``fid`` has no mapping."""
    if fid not in SOURCES:
        raise KeyError(f"no citation mapping for registry id {fid!r}; add it to SOURCES")
    return (*SOURCES[fid], ATTNREF_KEY)


def formulation_bibtex(fid: str) -> str:
    """BibTeX for registry entry ``fid``: its sources, then attnref, separated by blank lines
    (``KeyError`` if ``fid`` has no mapping in :data:`SOURCES`)."""
    entries = [bibtex(k, attnref_entry() if k == ATTNREF_KEY else ENTRIES[k]) for k in keys(fid)]
    return "\n\n".join(entries) + "\n"


# ``attnref cite NAME``: besides a registry id, the names people use. Each maps to a registry id
# ("formulation", id) or to a source of ENTRIES ("source", key); ``tests/test_cli_cite.py``
# checks that every one resolves to what it names.
FORMULATION_ALIASES: dict[str, str] = {
    "flash": "blockwise",
    "online softmax": "blockwise",
    "flash decoding": "split_kv",
    "kv cache": "kv_cache",
    "multi-head attention": "concat",
    "mha": "concat",
    "qk ov circuits": "column",
    "rotary": "rope",
    "ring attention": "ring",
    "striped attention": "striped",
    "deepspeed ulysses": "ulysses",
    "megatron": "tensor_parallel",
    "context parallelism": "all_gather",
    "linear attention": "linear_quadratic",
}
SOURCE_ALIASES: dict[str, str] = {
    "transformer": "vaswani2017attention",
    "attention is all you need": "vaswani2017attention",
    "transformer circuits": "elhage2021mathematical",
    "flashattention": "dao2022flashattention",
    "gqa": "ainslie2023gqa",
    "grouped-query attention": "ainslie2023gqa",
    "mqa": "shazeer2019fast",
    "multi-query attention": "shazeer2019fast",
    "roformer": "su2024roformer",
    "performer": "choromanski2021performers",
    "favor+": "choromanski2021performers",
    "megatron-lm": "shoeybi2019megatron",
    "llama 3": "grattafiori2024llama3",
}


@dataclass(frozen=True)
class Resolved:
    """What ``attnref cite NAME`` names: a registry id (``kind`` ``"formulation"``) or the key
    of a source in :data:`ENTRIES` (``kind`` ``"source"``)."""

    kind: str
    name: str


def _norm(text: str) -> str:
    """``text`` compared without case, spaces or punctuation (``Flash-Decoding`` ==
    ``flash_decoding``)."""
    return "".join(c for c in text.lower() if c.isalnum())


def _surnames(entry: Entry) -> list[str]:
    """The surnames of ``entry``'s authors (``Last, First and ...``), braces and accents'
    commands removed; none for an entry without an author."""
    authors = dict(entry.fields).get("author", "")
    names = [a.split(",")[0] for a in authors.split(" and ") if a.strip() and a != "others"]
    return [_norm(n.replace("\\", "")) for n in names]


def _tiers() -> list[dict[str, set[Resolved]]]:
    """Normalised name -> what it names, in order of precedence: registry ids, formulation
    titles and aliases, source keys and aliases, first authors, any author."""
    from attnref._src.core.registry import formulations

    tiers: list[dict[str, set[Resolved]]] = [{}, {}, {}, {}, {}]

    def add(tier: int, name: str, target: Resolved) -> None:
        tiers[tier].setdefault(_norm(name), set()).add(target)

    for f in formulations():
        add(0, f.id, Resolved("formulation", f.id))
        add(1, f.title, Resolved("formulation", f.id))
        add(1, f.title.split(" (")[0], Resolved("formulation", f.id))
    for alias, fid in FORMULATION_ALIASES.items():
        add(1, alias, Resolved("formulation", fid))
    for key, entry in ENTRIES.items():
        add(2, key, Resolved("source", key))
        for position, surname in enumerate(_surnames(entry)):
            add(3 if position == 0 else 4, surname, Resolved("source", key))
    for alias, key in SOURCE_ALIASES.items():
        add(2, alias, Resolved("source", key))
    return tiers


def resolve(name: str) -> Resolved:
    """What ``name`` names, case, spaces and punctuation ignored: a registry id, a formulation's
    title or alias (:data:`FORMULATION_ALIASES`), a source's key, alias
    (:data:`SOURCE_ALIASES`) or author (its first author before any other). ``LookupError``,
    its message one line, when nothing or several sources match (the close names suggested)."""
    import difflib

    tiers = _tiers()
    wanted = _norm(name)
    for tier in tiers:
        found = tier.get(wanted, set())
        if len(found) == 1:
            return next(iter(found))
        if found:
            keys = ", ".join(sorted(r.name for r in found))
            raise LookupError(f"{name!r} names several sources: {keys}; cite one of them by key")
    known = [n for tier in tiers for n in tier]
    close = difflib.get_close_matches(wanted, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise LookupError(
        f"nothing to cite is called {name!r}{hint}; give a registry id (attnref list shows "
        "them), a formulation's title, a source's BibTeX key or its author"
    )


def _plain(value: str) -> str:
    """A BibTeX value as plain text: braces dropped, ``{\\L}`` and ``{\\'e}`` as their letters."""
    for command in ("\\L", "\\'", "\\c", "\\", "{", "}", "$"):
        value = value.replace(command, "L" if command == "\\L" else "")
    return value


def source_text(key: str) -> str:
    """Source ``key`` of :data:`ENTRIES` as one line of plain text, the registry's style:
    ``Surname et al. (year). Title. Venue. Address.`` (``A & B`` for two authors)."""
    fields = dict(ENTRIES[key].fields)
    authors = [a.strip() for a in fields.get("author", "").split(" and ") if a.strip()]
    surnames = [_plain(a.split(",")[0]) for a in authors]
    who = (
        f"{surnames[0]} et al." if len(authors) > 2 or "others" in authors else " & ".join(surnames)
    )
    venue = fields.get("booktitle") or fields.get("journal") or fields.get("howpublished", "")
    where = fields.get("url") or (f"https://doi.org/{fields['doi']}" if "doi" in fields else "")
    year, title = fields["year"], fields["title"]
    parts = [f"{who} ({year})", title] if who else [f"{title} ({year})"]
    return " ".join(_plain(p).rstrip(".") + "." for p in [*parts, venue, where] if p).rstrip(".")


def citing(key: str) -> tuple[str, ...]:
    """The registry ids whose sources include ``key``, in :data:`SOURCES`' order."""
    return tuple(fid for fid, sources in SOURCES.items() if key in sources)
