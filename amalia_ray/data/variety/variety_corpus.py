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
  handbooks under `usr/share/doc/HTML/{pt,pt_BR}/APP/`): prose, paragraphs aligned by file and position.

Both sides are cleaned alike (markup, format placeholders and keyboard accelerators removed); pairs that are
identical once cleaned, shorter than `min_words`, or not Portuguese on both sides (language ID) are dropped. Each
pair keeps its package and a project group (`group_of`: its Portuguese translation team), so a model can be
trained without a whole group and tested on it: what is learned is then the variety, not one team's wording or one
product's vocabulary.
"""

from __future__ import annotations

import difflib
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
# translator). LibreOffice's help pages and Mozilla's language packs carry no header: their package names the team.
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
_PLACEHOLDER = re.compile(r"\{[^{}]{0,80}\}|%(?:\([A-Za-z_]\w*\)|\d+\$)?[-+ #0]*\d*(?:\.\d+)?(?:hh|ll|[hlLqjzt])?"
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
                     r"langpack-pt-(?:PT|BR)@[^/]+\.xpi$|/share/(?:help|doc/HTML)/(?:pt|pt_PT|pt_BR)/.+\.(?:page|docbook|xml)$")
_DOC_PATH = re.compile(r"/share/(help|doc/HTML)/([^/]+)/(.+)$")
# what a manual's paragraphs hold besides prose: comments, code and terminal listings (dropped whole)
_DOC_DROP_EDGE = re.compile(r"<!--|-->|<(/?)(screen|programlisting|synopsis|literallayout|code)\b[^<>]{0,1000}>", re.I)
_DOC_EDGE = re.compile(r"<(/?)(p|para|simpara|title|subtitle|term|desc|entry)\b([^<>]{0,1000})>", re.I)
_DOC_ENTITY = re.compile(r"&(?!(?:amp|lt|gt|quot|apos|#\d+|#x[0-9a-fA-F]+);)[A-Za-z][\w.:-]{0,100};")
_DOC_MARKUP = re.compile(r"<[A-Za-z][\w:-]{0,50}|&[A-Za-z][\w.:-]{0,100};|\d+")
_EMAIL = re.compile(r"<email\b|\b[\w.+-]+@[\w-]+\.[\w.-]+")
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
    kept, start, dropping, depth = [], 0, None, 0  # dropping: "comment", a listing's tag, or None
    for m in _DOC_DROP_EDGE.finditer(text):
        token, closing, tag = m.group(0), m.group(1), (m.group(2) or "").lower()
        if dropping is None:
            if token == "<!--" or (tag and not closing):
                kept.append(text[start:m.start()])
                dropping, depth = ("comment", 1) if token == "<!--" else (tag, 1)
        elif dropping == "comment":
            if token == "-->":
                dropping, start = None, m.end()
        elif tag == dropping:
            depth += -1 if closing else 1
            if depth == 0:
                dropping, start = None, m.end()
    if dropping is None:
        kept.append(text[start:])
    return " ".join(kept)


def _doc_paragraphs(data: bytes) -> dict[str, str]:
    """The innermost paragraphs, titles, terms and table cells of a manual page (DocBook, as KDE's handbooks and
    older GNOME help are written, or Mallard, as GNOME's and MATE's are), in document order, keyed
    "position|signature": the signature (the element, the markup, entities and numbers inside it) is the same in
    both varieties' translations of a paragraph, so `aligned_keys` pairs them even where one translation has a
    paragraph more. A paragraph naming an e-mail (translator credits) is left empty; entities (`&kappname;`) are
    removed from the text."""
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
                content = text[start:m.start()]
                signature = ",".join([tag, *_DOC_MARKUP.findall(content)])[:200]
                blocks.append((signature, "" if _EMAIL.search(content) else _DOC_ENTITY.sub(" ", content)))
    return {f"{i}|{signature}": block for i, (signature, block) in enumerate(blocks)}


MAX_DIFFED_PARAGRAPHS = 5000  # a manual page's paragraphs aligned by their signatures (more: only equal counts)


def aligned_keys(source: str, pt_keys, br_keys) -> list[tuple[str, str]]:
    """The (pt-PT key, pt-BR key) of each message both sides have: the same id, or for a manual page the longest
    matching runs of paragraph signatures in document order (difflib)."""
    if source != "doc":
        return [(key, key) for key in sorted(pt_keys & br_keys)]
    pt, br = (sorted(keys, key=lambda k: int(k.split("|", 1)[0])) for keys in (pt_keys, br_keys))
    if max(len(pt), len(br)) > MAX_DIFFED_PARAGRAPHS:
        return list(zip(pt, br)) if len(pt) == len(br) else []
    matcher = difflib.SequenceMatcher(None, [k.split("|", 1)[1] for k in pt], [k.split("|", 1)[1] for k in br],
                                      autojunk=False)
    return [(pt[i + k], br[j + k]) for i, j, n in matcher.get_matching_blocks() for k in range(n)]


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
        found.setdefault((family, unit), {}).setdefault(_LOCALE[locale], {}).update(messages)
        if teams is not None and _LOCALE[locale] == PT_PT and team:
            teams[(family, unit)] = team
    return found


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
                units.setdefault(key, {}).setdefault(variety, {}).update(messages)
    pairs, counts, seen = [], Counter(), set()
    # a manual has no header: its team is the one its package's catalogs name
    family_teams = {family: team for (family, _), team in sorted(teams.items()) if team_of(team)}
    for (family, unit), sides in sorted(units.items()):
        if PT_PT not in sides or PT_BR not in sides:
            continue
        source = unit.split(":", 1)[0]
        group = group_of(family, source, teams.get((family, unit)) or family_teams.get(family, ""))
        for key, br_key in aligned_keys(source, sides[PT_PT].keys(), sides[PT_BR].keys()):
            pt, br = clean_message(sides[PT_PT][key]), clean_message(sides[PT_BR][br_key])
            key = key.split("|", 1)[0] if source == "doc" else key  # a manual's paragraph: its position
            counts[f"{source}:aligned"] += 1
            if pt.lower() == br.lower():
                counts[f"{source}:identical"] += 1
            elif min(len(pt.split()), len(br.split())) < min_words:
                counts[f"{source}:short"] += 1
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
