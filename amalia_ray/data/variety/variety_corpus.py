"""Training text for the pt-PT / pt-BR variety classifier: the same messages translated separately by the
Portuguese and the Brazilian teams of free software projects, read straight from Debian packages (`.deb` files, as
`apt-get download` fetches them; nothing is installed).

- LibreOffice's help (`libreoffice-help-pt` / `-pt-br`): HTML pages whose paragraphs carry the same `id` in both
  languages, so pairs are aligned by page and paragraph id.
- Firefox ESR and Thunderbird language packs (`*-l10n-pt-pt` / `-pt-br`): Fluent (`.ftl`) and `.properties`
  strings aligned by file and message id.
- gettext message catalogs (`usr/share/locale/{pt,pt_PT,pt_BR}/LC_MESSAGES/*.mo` of any package, LibreOffice's
  own UI catalogs too): messages aligned by their msgid.
- Manuals (`usr/share/help/{pt,pt_BR}/APP/` of GNOME and MATE applications, Mallard or DocBook, and KDE's
  handbooks under `usr/share/doc/HTML/{pt,pt_BR}/APP/`): prose, paragraphs aligned by file and by their markup,
  preferring pairs that share words (`aligned_keys`), a pair of very unlike lengths dropped as misaligned.

Both sides are cleaned alike (markup, format placeholders and keyboard accelerators removed); pairs that are
identical once cleaned, shorter than `min_words`, or not Portuguese on both sides (language ID) are dropped. Each
pair keeps its package and a project group (`group_of`: its Portuguese translation team), so a model can be
trained without a whole group and tested on it: what is learned is then the variety, not one team's wording or one
product's vocabulary.
"""

from __future__ import annotations

import gettext
import html
import io
import json
import re
import struct
import tarfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.read.streams import _Limited

PT_PT, PT_BR = "pt-PT", "pt-BR"
# locale folder names of each variety (gettext: pt is Portugal's; Mozilla and LibreOffice spell them out)
_LOCALE = {"pt": PT_PT, "pt_PT": PT_PT, "pt-PT": PT_PT, "pt_BR": PT_BR, "pt-BR": PT_BR}
# A project group is one translation team (on the Portuguese side): a model trained without a group and tested on
# it has seen nothing that team wrote. A gettext catalog's team is read from its header (`Language-Team`), which
# names the team's list or site; a catalog whose header names no known team is "other" (many small teams, or one
# translator). LibreOffice's help pages and Mozilla's language packs carry no header: their package names the team;
# a manual has none either: its team is the one its package's catalogs name (`manual_team`).
TEAMS = {
    "kde": r"kde\.org|\bkde\b",
    "gnome": r"gnome",
    "xfce": r"xfce",
    "mate": r"\bmate\b",
    "libreoffice": r"documentfoundation|libreoffice",
    "mozilla": r"mozilla",
    "gnu": r"translation-team-pt|translationproject",  # the Translation Project: GNU and many other tools
    "debian": r"debian",
    # Ubuntu's translators (Rosetta); gettext's untouched template header says `LANGUAGE <LL@li.org>`
    "launchpad": r"\bpt(?:_PT)?@li\.org\b|launchpad",
}
_TEAM_PATTERNS = {team: re.compile(pattern, re.IGNORECASE) for team, pattern in TEAMS.items()}
HEADERLESS = {"libreoffice": ("libreoffice-help",), "mozilla": ("firefox", "thunderbird")}


def team_of(language_team: str) -> str | None:
    """The known team a catalog header's `Language-Team` names, else None."""
    return next((team for team, pattern in _TEAM_PATTERNS.items() if pattern.search(language_team)), None)


def group_of(package: str, source: str, language_team: str = "") -> str:
    """The project group of a unit: a catalog's team as its header names it (a manual's, as its package's catalogs
    name it), a help page's or language pack's by its package; else "other"."""
    if source in ("mo", "doc"):
        return team_of(language_team) or "other"
    return next((group for group, prefixes in HEADERLESS.items() if package.startswith(prefixes)), "other")


# what the two teams' strings carry besides words: markup, placeholders, accelerators
_TAG = re.compile(r"<[^>]{0,200}>")
_PLACEHOLDER = re.compile(r"\{[^{}]{0,80}\}|%(?:\([A-Za-z_]\w*\)|\d+\$)?[-+#0]*\d*(?:\.\d+)?(?:hh|ll|[hlLqjzt])?"
                          r"[diouxXeEfFgGcsSpn%]|%\d+|\$[A-Z_]+\$?|&[a-z]+;|&#\d+;")
_ACCEL = re.compile(r"(?<![\w&])[_&~](?=\w)")


def clean_message(text: str) -> str:
    text = html.unescape(_TAG.sub(" ", text.replace("\\n", " ")))
    text = _ACCEL.sub("", _PLACEHOLDER.sub(" ", text))
    return " ".join(text.split())


# one catalog, help page or language pack is far below this; a member over it is counted and left unread
MAX_MEMBER_BYTES = 64 << 20


def _deb_members(path: Path, wanted: re.Pattern) -> Iterator[tuple[str, bytes | None]]:
    """(path, content) of the files of a .deb's data archive whose path matches `wanted`, streamed (an ar archive
    holding a compressed tar, read with the standard library and zstandard, so any machine can build the corpus);
    content None for a member over MAX_MEMBER_BYTES."""
    import lzma
    import zlib

    import zstandard

    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise AmaliaError(f"{path}: not a Debian package (no ar header)")
        while header := f.read(60):
            try:
                name, size = header[:16].decode("ascii").strip().rstrip("/"), int(header[48:58])
            except (UnicodeDecodeError, ValueError):
                raise AmaliaError(f"{path}: a broken ar member header at byte {f.tell() - len(header)}") from None
            if not name.startswith("data.tar"):
                f.seek(size + size % 2, 1)
                continue
            raw = io.BufferedReader(_Limited(f, size))  # this ar member's bytes only, streamed
            stream = zstandard.ZstdDecompressor().stream_reader(raw) if name.endswith(".zst") else raw
            try:
                with tarfile.open(fileobj=stream, mode="r|*") as tar:
                    for member in tar:
                        if member.isfile() and wanted.search(member.name):
                            name = member.name.removeprefix("./")
                            yield name, (tar.extractfile(member).read() if member.size <= MAX_MEMBER_BYTES
                                         else None)
            except (tarfile.TarError, zstandard.ZstdError, lzma.LZMAError, zlib.error, EOFError, OSError) as e:
                raise AmaliaError(f"{path}: its data archive cannot be read ({type(e).__name__}: {e})") from None
            return
    raise AmaliaError(f"{path}: no data archive inside")


_WANTED = re.compile(r"/(?:pt|pt_PT|pt_BR)/LC_MESSAGES/[^/]+\.mo$|/help/(?:pt|pt-BR)/text/.+\.html$|"
                     r"langpack-pt-(?:PT|BR)@[^/]+\.xpi$|"
                     r"/share/(?:help|doc/HTML)/(?:pt|pt_PT|pt_BR)/.+\.(?:page|docbook|xml)$")
_DOC_PATH = re.compile(r"/share/(help|doc/HTML)/([^/]+)/(.+)$")
# what a manual's paragraphs hold besides prose: comments, code and terminal listings (dropped whole)
_DOC_DROP_EDGE = re.compile(r"<!--|-->|<(/?)(screen|programlisting|\w*synopsis|literallayout|code)\b[^<>]{0,1000}>",
                            re.I)
_DOC_EDGE = re.compile(r"<(/?)(p|para|simpara|title|subtitle|term|desc|entry)\b([^<>]{0,1000})>", re.I)
_DOC_ENTITY = re.compile(r"&(?!(?:amp|lt|gt|quot|apos|#\d+|#x[0-9a-fA-F]+);)[A-Za-z][\w.:-]{0,100};")
_DOC_MARKUP = re.compile(r"<[A-Za-z][\w:-]{0,50}|&[A-Za-z][\w.:-]{0,100};|\d+")
MAX_MANUAL_PARAGRAPHS = 20_000  # of one manual page (KDE's largest handbook pages hold a few thousand)
MAX_ALIGNED_CELLS = 4_000_000  # pt-PT paragraphs x pt-BR paragraphs of a page aligned by common subsequence
_EMAIL = re.compile(r"<email\b|(?<![\w.+-])[\w.+-]{1,64}@[\w-]{1,63}\.[\w.-]{1,253}")
_ELEMENT_EDGE = re.compile(r"<(/?)(p|h[1-6]|td)\b([^<>]{0,1000})>", re.I)
_ID = re.compile(r"\bid=\"([^\"]{1,200})\"")
_FTL_MESSAGE = re.compile(r"^(-?[A-Za-z][\w-]*)\s*=(.*)$")
_FTL_ATTRIBUTE = re.compile(r"^\s+\.([\w-]+)\s*=(.*)$")


def _mo_messages(data: bytes) -> tuple[dict[str, str], str]:
    """(messages by msgid, the header's Language-Team)."""
    translations = gettext.GNUTranslations(io.BytesIO(data))
    catalog = translations._catalog  # msgid (or (msgid, n)) -> msgstr
    out = {}
    for key, value in catalog.items():
        if not key or not value:  # the header, untranslated entries
            continue
        out[repr(key)] = value
    return out, translations.info().get("language-team", "")


def _help_paragraphs(data: bytes) -> dict[str, str]:
    """The content of each paragraph, heading or cell that has an id (one pass over the tags: a page of unclosed
    tags costs no more than a well-formed one)."""
    text, out, opened = data.decode("utf-8", "replace"), {}, None
    for m in _ELEMENT_EDGE.finditer(text):
        closing, tag = m.group(1), m.group(2).lower()
        if not closing:
            found = _ID.search(m.group(3))
            opened = (tag, found.group(1), m.end()) if found else None
        elif opened and opened[0] == tag:
            out[opened[1]] = text[opened[2]:m.start()]
            opened = None
    return out


def _without_code(text: str) -> str:
    """`text` less its comments and code or terminal listings (with what they hold), in one pass: an unclosed one
    drops the rest of the text, and no input costs more than its length."""
    kept, start = [], 0
    listing, depth, comment = None, 0, False  # the listing being dropped and its nesting; inside a comment
    for m in _DOC_DROP_EDGE.finditer(text):
        token, closing, tag = m.group(0), m.group(1), (m.group(2) or "").lower()
        if comment:
            if token == "-->":
                comment = False
                start = m.end() if listing is None else start
        elif token == "<!--":
            if listing is None:
                kept.append(text[start:m.start()])
            comment = True
        elif token == "-->" or token.endswith("/>"):  # a stray end of comment; an empty <code/>
            continue
        elif listing is None:
            if not closing:
                kept.append(text[start:m.start()])
                listing, depth = tag, 1
        elif tag == listing:
            depth += -1 if closing else 1
            if depth == 0:
                listing, start = None, m.end()
    if listing is None and not comment:
        kept.append(text[start:])
    return " ".join(kept)


def _doc_paragraphs(data: bytes) -> dict[str, str]:
    """The innermost paragraphs, titles, terms and table cells of a manual page (DocBook, as KDE's handbooks and
    older GNOME help are written, or Mallard, as GNOME's and MATE's are), in document order, keyed
    "position|signature": the signature (the element, the markup, entities and numbers inside it) is mostly the same
    in both varieties' translations of a paragraph, so `aligned_keys` pairs them even where one translation has a
    paragraph more (one whose markup a team changed stays unpaired). A paragraph naming an e-mail (translator
    credits) is left empty; entities (`&kappname;`) are removed from the text. (LibreOffice's help pages key their
    paragraphs by id instead: `_help_paragraphs`.)"""
    text = _without_code(data.decode("utf-8", "replace"))
    blocks, open_blocks = [], []  # [tag, where its content starts, whether a block opened inside it]
    for m in _DOC_EDGE.finditer(text):
        closing, tag = m.group(1), m.group(2).lower()
        if m.group(3).rstrip().endswith("/"):  # <p/>: an empty element
            continue
        if not closing:
            if open_blocks:
                open_blocks[-1][2] = True
            open_blocks.append([tag, m.end(), False])
            continue
        while open_blocks and open_blocks[-1][0] != tag:  # an unclosed element inside: given up
            open_blocks.pop()
        if open_blocks:
            _, start, has_block_inside = open_blocks.pop()
            if not has_block_inside:
                if len(blocks) == MAX_MANUAL_PARAGRAPHS:  # a crafted page of empty elements: the rest unread
                    break
                content = text[start:m.start()]
                signature = ",".join([tag, *_DOC_MARKUP.findall(content)])[:200]
                blocks.append((signature, "" if _EMAIL.search(content) else _DOC_ENTITY.sub(" ", content)))
    return {f"{i}|{signature}": block for i, (signature, block) in enumerate(blocks)}


def aligned_keys(source: str, pt: dict[str, str], br: dict[str, str]) -> list[tuple[str, str]]:
    """The (pt-PT key, pt-BR key) of each message both sides have: the same id, or, for a manual page, the pairs of
    paragraphs of the same signature, in document order, that share the most words (one translation may have a
    paragraph more; among paragraphs of the same markup, the words they share, names, numbers, the words both
    varieties write alike, say which is which). A page whose two sides hold more than MAX_ALIGNED_CELLS paragraph
    pairs is aligned only where their signatures are the same all through."""
    if source != "doc":
        return [(key, key) for key in sorted(pt.keys() & br.keys())]
    pt_keys, br_keys = (sorted(side, key=lambda k: int(k.split("|", 1)[0])) for side in (pt, br))
    a, b = [k.split("|", 1)[1] for k in pt_keys], [k.split("|", 1)[1] for k in br_keys]
    if a == b:
        return list(zip(pt_keys, br_keys))
    if len(a) * len(b) > MAX_ALIGNED_CELLS:
        return []
    words = [[frozenset(re.findall(r"\w+", side[k].lower())) for k in keys] for side, keys in ((pt, pt_keys),
                                                                                                (br, br_keys))]
    return [(pt_keys[i], br_keys[j]) for i, j in _best_alignment(a, b, *words)]


def _best_alignment(a: list[str], b: list[str], a_words: list[frozenset], b_words: list[frozenset]
                    ) -> list[tuple[int, int]]:
    """(i, j) pairs, in order, of equal signatures a[i] == b[j], maximizing the sum of 1 + the pair's word overlap
    (Jaccard): the most pairs, and of those the most alike. The textbook O(len(a) * len(b)) table (at
    MAX_ALIGNED_CELLS, about 130 MB of Python floats for a few seconds; a real handbook page: ~0.1 M cells)."""
    def gain(i: int, j: int) -> float:
        union = len(a_words[i] | b_words[j])
        return 1 + (len(a_words[i] & b_words[j]) / union if union else 0)

    best = [[0.0] * (len(b) + 1) for _ in range(len(a) + 1)]  # best[i][j]: of a[i:] and b[j:]
    for i in range(len(a) - 1, -1, -1):
        row, below = best[i], best[i + 1]
        for j in range(len(b) - 1, -1, -1):
            row[j] = max(below[j], row[j + 1], below[j + 1] + gain(i, j) if a[i] == b[j] else 0.0)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j] and best[i][j] == best[i + 1][j + 1] + gain(i, j):
            out.append((i, j))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def _ftl_messages(text: str) -> dict[str, str]:
    """Fluent: `id = value`, continued on indented lines, and `.attribute = value` lines under it."""
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            current = None if not line.strip() else current
            continue
        if m := _FTL_MESSAGE.match(line):
            current = m.group(1)
            out[current] = m.group(2).strip()
        elif current and (m := _FTL_ATTRIBUTE.match(line)):
            out[f"{current}.{m.group(1)}"] = m.group(2).strip()
        elif current and line.startswith((" ", "\t")) and not line.strip().startswith(("[", "*", "}")):
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


def _properties(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")) and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def _langpack_messages(data: bytes) -> dict[str, str]:
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            name = info.filename
            if not name.endswith((".ftl", ".properties")) or info.file_size > MAX_MEMBER_BYTES:
                continue
            where = re.sub(r"pt-(?:PT|BR)", "LOCALE", name)  # the same file in both packs
            text = z.read(info).decode("utf-8", "replace")
            messages = _ftl_messages(text) if name.endswith(".ftl") else _properties(text)
            out.update({f"{where}#{key}": value for key, value in messages.items()})
    return out


def _unit(name: str, data: bytes) -> tuple[str, str, dict[str, str], str]:
    """(locale folder, unit, messages, translation team or "") of one matching member."""
    if name.endswith(".mo"):
        return (name.split("/LC_MESSAGES/")[0].rsplit("/", 1)[1], "mo:" + name.rsplit("/", 1)[1],
                *_mo_messages(data))
    if doc := _DOC_PATH.search(name):
        return doc.group(2), f"doc:{doc.group(1)}/{doc.group(3)}", _doc_paragraphs(data), ""
    if name.endswith(".html"):
        return (name.split("/help/")[1].split("/", 1)[0], "help:" + name.split("/text/", 1)[1],
                _help_paragraphs(data), "")
    return ("pt-PT" if "pt-PT@" in name else "pt-BR", "langpack:" + name.rsplit("@", 1)[1],
            _langpack_messages(data), "")


def package_messages(deb: Path, problems: Counter | None = None, teams: dict | None = None
                     ) -> dict[tuple[str, str], dict[str, dict[str, str]]]:
    """{(package, unit): {variety: {message key: text}}} of one .deb, a unit being a catalog, a help page or a
    language pack; `teams` gets {(package, unit): the pt-PT side's Language-Team} of each catalog. A member that
    cannot be parsed (a catalog in a charset Python lacks, a broken zip) or is too large is counted in `problems`
    and left out; the package's other members are kept."""
    package = deb.name.split("_", 1)[0]
    problems = Counter() if problems is None else problems
    found: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for name, data in _deb_members(deb, _WANTED):
        kind = name.rsplit(".", 1)[-1]
        if data is None:
            problems[f"{kind}:too_large"] += 1
            continue
        try:
            locale, unit, messages, team = _unit(name, data)
        except (OSError, LookupError, ValueError, UnicodeError, struct.error, zipfile.BadZipFile, IndexError):
            problems[f"{kind}:unreadable"] += 1
            continue
        # a language pack or help package holds one variety; both sides meet under the project's name
        family = re.sub(r"-(?:l10n-)?pt(?:-pt|-br)?$", "", package)
        if not _merge(found, (family, unit), _LOCALE[locale], messages):
            problems["doc:duplicate"] += 1
        if teams is not None and _LOCALE[locale] == PT_PT and team:
            teams[(family, unit)] = team
    return found


def _unlike_lengths(pt: str, br: str) -> bool:
    """Over 2.5 times as many words on one side: two paragraphs of a manual paired by their markup but not
    translations of each other."""
    a, b = len(pt.split()), len(br.split())
    return max(a, b) > 2.5 * min(a, b)


def _merge(units: dict, key: tuple[str, str], variety: str, messages: dict[str, str]) -> bool:
    """Add a unit's messages of one variety (a unit's catalogs in several folders or packages add up); a manual
    page's paragraphs are positions of one file, so a second copy of it (help/pt and help/pt_PT, two packages) is
    left out: False."""
    sides = units.setdefault(key, {})
    if key[1].startswith("doc:") and variety in sides:
        return False
    sides.setdefault(variety, {}).update(messages)
    return True


def manual_team(unit: str, catalogs: dict[str, str]) -> str:
    """The Language-Team a manual goes by ({catalog unit: team} of its package): its application's catalog's
    (`help/APP/...`, `doc/HTML/APP/...` and `mo:APP.mo`), else the known team most of the package's catalogs
    name (ties: the first by name); "" if none."""
    app = re.sub(r"^doc:(?:help|doc/HTML)/", "", unit).split("/", 1)[0]
    if team_of(catalogs.get(f"mo:{app}.mo", "")):
        return catalogs[f"mo:{app}.mo"]
    known = Counter(team_of(t) for t in catalogs.values() if team_of(t))
    if not known:
        return ""
    best = min(known, key=lambda team: (-known[team], team))
    return next(t for _, t in sorted(catalogs.items()) if team_of(t) == best)


def build_pairs(debs: list[Path], min_words: int = 3, detect=None) -> tuple[list[dict], dict]:
    """Aligned (pt-PT, pt-BR) pairs from the packages, and what was kept and dropped per source. `detect`: a
    language-ID function text -> (language, score) (the data stage's fastText by default)."""
    if detect is None:
        from amalia_ray.data.steps.language import detect_language as detect
    units: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    versions = {}
    problems: Counter = Counter()
    teams: dict[tuple[str, str], str] = {}
    for deb in sorted(debs):
        versions[deb.name.split("_", 1)[0]] = deb.name.split("_")[1] if deb.name.count("_") >= 2 else None
        for key, sides in package_messages(deb, problems, teams).items():
            for variety, messages in sides.items():
                if not _merge(units, key, variety, messages):
                    problems["doc:duplicate"] += 1
    pairs, counts, seen = [], Counter(), set()
    catalog_teams: dict[str, dict[str, str]] = {}  # family -> {catalog unit: its pt-PT Language-Team}
    for (family, unit), team in teams.items():
        catalog_teams.setdefault(family, {})[unit] = team
    for (family, unit), sides in sorted(units.items()):
        if PT_PT not in sides or PT_BR not in sides:
            continue
        source = unit.split(":", 1)[0]
        team = manual_team(unit, catalog_teams.get(family, {})) if source == "doc" else teams.get((family, unit), "")
        group = group_of(family, source, team)
        for key, br_key in aligned_keys(source, sides[PT_PT], sides[PT_BR]):
            pt, br = clean_message(sides[PT_PT][key]), clean_message(sides[PT_BR][br_key])
            key = key.split("|", 1)[0] if source == "doc" else key  # a manual's paragraph: its position
            counts[f"{source}:aligned"] += 1
            if pt.lower() == br.lower():
                counts[f"{source}:identical"] += 1
            elif min(len(pt.split()), len(br.split())) < min_words:
                counts[f"{source}:short"] += 1
            elif source == "doc" and _unlike_lengths(pt, br):
                counts[f"{source}:unlike"] += 1
            elif (pt, br) in seen:
                counts[f"{source}:repeated"] += 1
            elif detect(pt)[0] != "pt" or detect(br)[0] != "pt":
                counts[f"{source}:not_portuguese"] += 1
            else:
                seen.add((pt, br))
                counts[f"{source}:kept"] += 1
                pairs.append({"pair": f"{family}/{unit}#{key}", "package": family, "group": group,
                              "source": source, PT_PT: pt, PT_BR: br})
    summary = {"packages": versions, "counts": dict(sorted((counts + problems).items())),
               "pairs_by_group": dict(sorted(Counter(p["group"] for p in pairs).items()))}
    return pairs, summary


def write_variety_corpus(debs_dir: Path, out: Path, min_words: int = 3) -> dict:
    """`amalia data variety-corpus`: OUT/pairs.jsonl (one aligned pair per line) and OUT/summary.json."""
    debs = sorted(Path(debs_dir).glob("*.deb"))
    if not debs:
        raise AmaliaError(f"no .deb files in {debs_dir}: download the packages first (`make variety-model` lists "
                          "them; `apt-get download NAME` fetches one)")
    pairs, summary = build_pairs(debs, min_words)
    if not pairs:
        raise AmaliaError(f"{debs_dir}: no pt-PT / pt-BR pairs in {len(debs)} packages (each variety's package of "
                          "a project is needed: e.g. libreoffice-help-pt and libreoffice-help-pt-br)")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pairs.jsonl", "w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")
    summary["pairs"] = len(pairs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def read_pairs(path: Path) -> list[dict]:
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                pair = json.loads(line)
                if not (isinstance(pair, dict) and isinstance(pair.get(PT_PT), str)
                        and isinstance(pair.get(PT_BR), str)):
                    raise ValueError(f"needs string fields {PT_PT!r} and {PT_BR!r}")
            except ValueError as e:
                raise AmaliaError(f"{path} line {n}: {e}") from None
            pairs.append(pair)
    return pairs
