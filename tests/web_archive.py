"""A small web archive made in the tests from real HTML: the European-Portuguese Debian Reference that the
debian-reference-pt package ships, cut into one page per section, wrapped in a site's boilerplate (menu, cookie
notice, footer) and captured three times over the years under varying forms of its URL, as WARC files."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

HTML_DIR = Path("/usr/share/debian-reference")
SITE = "debian-reference"
COOKIES = "Este sítio utiliza cookies para melhorar a sua experiência de navegação."
HEADER = ("<header><nav><ul><li><a href='/'>Início</a></li><li><a href='/noticias/'>Notícias</a></li>"
          "<li><a href='/contactos/'>Contactos</a></li></ul></nav>"
          f"<div class='cookies'>{COOKIES} "
          "<button>Aceitar cookies</button></div></header>")
FOOTER = ("<footer><p>© Projeto Debian — todos os direitos reservados. Política de privacidade.</p>"
          "<ul><li><a href='/mapa/'>Mapa do sítio</a></li><li><a href='/acessibilidade/'>Acessibilidade</a></li>"
          "</ul></footer>")
BOILERPLATE = ("Este sítio utiliza cookies", "todos os direitos reservados", "Mapa do sítio")
# (year, date, how the URL was written that year)
CAPTURES = [
    (2019, "2019-03-01T08:00:00Z", "http://www.debian.org{path}?utm_source=feed&utm_medium=rss"),
    (2021, "20210615120000", "https://debian.org{path}/"),
    (2023, "2023-11-20T17:30:00Z", "HTTPS://WWW.Debian.org:443{path}#topo"),
]


def section_pages(per_chapter: int) -> list[tuple[str, str]]:
    """(path, HTML of one section) for the first `per_chapter` sections of each chapter whose main text (what
    main-content extraction keeps of the page, a section of mostly tables may keep little) has 150 words or more."""
    from amalia_ray.data.read.readers import html_main_text

    pages = []
    for chapter in sorted(HTML_DIR.glob("ch*.pt.html")):
        body = re.search(r"<body[^>]*>(.*)</body>", chapter.read_text(encoding="utf-8"), re.S).group(1)
        taken = 0
        for i, part in enumerate(re.split(r'(?=<div class="section">)', body)[1:]):
            if taken < per_chapter and len(html_main_text(page_html(part)).split()) >= 150:
                pages.append((f"/doc/manuals/{SITE}/{chapter.name.split('.')[0]}/s{i:02}.pt.html", part))
                taken += 1
    return pages


def page_html(section: str) -> str:
    return (f"<html><head><meta charset='utf-8'><title>Referência Debian</title></head><body>{HEADER}"
            f"<main><article>{section}</article></main>{FOOTER}</body></html>")


def warc_record(uri: str, date: str, html: str) -> bytes:
    body = html.encode()
    http = (f"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body
    record_id = hashlib.sha1(f"{uri} {date}".encode()).hexdigest()
    head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:uuid:{record_id[:32]}>\r\n"
            f"WARC-Target-URI: {uri}\r\nWARC-Date: {date}\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n").encode()
    return head + http + b"\r\n\r\n"


def build_archive(folder: Path, pages: list[tuple[str, str]]) -> dict:
    """One WARC file per capture year. A page grew over time: the 2019 capture lacks the section's last
    paragraph. The 2023 capture of every page is the one a `latest` selection keeps. Returns what was written."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for year, date, url in CAPTURES:
        records = []
        for path, section in pages:
            html = section if year > 2019 else section[: section.rfind("<p>")] or section
            records.append(warc_record(url.format(path=path), date, page_html(html)))
        files[year] = folder / f"arquivo-{year}.warc.gz"
        files[year].write_bytes(gzip.compress(b"".join(records)))
    return {"files": files, "paths": [p for p, _ in pages]}


def exam_items(sentences_in: list[str], sentences_out: list[str]) -> list[dict]:
    """PHEB-shaped items (the public schema: year, phase, subject, question, choices, answer): the first ones
    quote sentences that are in the archive, the others sentences that are not."""
    items = []
    for n, sentence in enumerate(sentences_in + sentences_out):
        items.append({"year": 2023, "phase": "1.ª Fase", "subject": "Informática", "question_group": "I",
                      "question_number": str(n + 1), "question": f"Leia o excerto: «{sentence}» O que descreve?",
                      "choices": ["Um comando", "Um pacote", "Um ficheiro", "Um utilizador"], "answer": 1,
                      "is_completion": False})
    return items


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")
    return path
