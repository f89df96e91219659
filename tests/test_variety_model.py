"""The learned pt-PT / pt-BR classifier: its training pairs read from Debian packages (built here in the real .deb,
gettext .mo, HTML help and language-pack formats), training, loading, and its use by the data stage's step and
the `amalia data variety` command."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from amalia_ray.cli import app
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.variety_model import VarietyModel, label_texts, pt_pt_scores
from amalia_ray.data.variety.variety_corpus import _doc_paragraphs, build_pairs, clean_message, group_of
from amalia_ray.data.variety.variety_training import (coverage_accuracy, reform_respellings, respelled,
                                                        smallest_margin, train_variety_model)


def mo_file(messages: dict[str, str], team: str = "") -> bytes:
    """A GNU gettext .mo catalog (what msgfmt writes), with the UTF-8 header entry (and a Language-Team)."""
    header = "Content-Type: text/plain; charset=UTF-8\n" + (f"Language-Team: {team}\n" if team else "")
    entries = sorted({"": header, **messages}.items())
    ids = b"".join(k.encode() + b"\0" for k, _ in entries)
    strs = b"".join(v.encode() + b"\0" for _, v in entries)
    n, start = len(entries), 28 + 16 * len(entries)
    id_at, str_at = start, start + len(ids)
    table_ids, table_strs = b"", b""
    for k, v in entries:
        table_ids += struct.pack("<2I", len(k.encode()), id_at)
        table_strs += struct.pack("<2I", len(v.encode()), str_at)
        id_at += len(k.encode()) + 1
        str_at += len(v.encode()) + 1
    return struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0) + table_ids + table_strs + ids + strs


def deb(path: Path, files: dict[str, bytes], zst: bool = False) -> Path:
    """A Debian package: an ar archive holding debian-binary and data.tar.xz (or data.tar.zst, as Ubuntu's)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w" if zst else "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    payload = buf.getvalue()
    if zst:
        import zstandard

        payload = zstandard.ZstdCompressor().compress(payload)
    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("data.tar.zst" if zst else "data.tar.xz", payload)):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    path.write_bytes(out)
    return path


def help_page(paragraphs: dict[str, str]) -> bytes:
    body = "".join(f'<p id="{pid}" class="paragraph">{text}</p>' for pid, text in paragraphs.items())
    return f"<html><body><p>Ajuda do LibreOffice</p>{body}</body></html>".encode()


def langpack(locale: str, messages: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    ftl = "".join(f"{k} = {v}\n" for k, v in messages.items())
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"localization/{locale}/browser/sample.ftl", "# comment\n" + ftl)
    return buf.getvalue()


PT = ["Não foi possível guardar o ficheiro do utilizador no ecrã", "O utilizador está a descarregar o ficheiro agora",
      "Escreva o carácter que pretende introduzir no registo",
      "O ficheiro foi guardado na sua área de trabalho"]
BR = ["Não foi possível salvar o arquivo do usuário na tela", "O usuário está baixando o arquivo agora",
      "Digite o caractere que você deseja inserir no registro", "O arquivo foi salvo na sua área de trabalho"]


def test_pairs_come_aligned_from_help_pages_language_packs_and_catalogs_of_real_debs(tmp_path):
    debs = tmp_path / "debs"
    debs.mkdir()
    deb(debs / "libreoffice-help-pt_7.4_all.deb", {"usr/share/libreoffice/help/pt/text/a.html": help_page(
        {"par_1": PT[0], "par_2": "Use the <b>Save</b> command to store the document on disk.", "par_3": "Igual aqui",
         "par_9": "Só deste lado existe"})})
    deb(debs / "libreoffice-help-pt-br_7.4_all.deb", {"usr/share/libreoffice/help/pt-BR/text/a.html": help_page(
        {"par_1": BR[0], "par_2": "Use o comando <b>Salvar</b> para guardar o documento no disco.",
         "par_3": "Igual aqui"})})
    deb(debs / "firefox-esr-l10n-pt-pt_1_all.deb", {
        "usr/lib/firefox-esr/browser/extensions/langpack-pt-PT@firefox-esr.mozilla.org.xpi":
            langpack("pt-PT", {"download-now": PT[1] + " { $name }"})})
    deb(debs / "firefox-esr-l10n-pt-br_1_all.deb", {
        "usr/lib/firefox-esr/browser/extensions/langpack-pt-BR@firefox-esr.mozilla.org.xpi":
            langpack("pt-BR", {"download-now": BR[1] + " { $name }"})})
    deb(debs / "coreutils_9.1_amd64.deb", {
        "usr/share/locale/pt/LC_MESSAGES/coreutils.mo": mo_file(
            {"type the %s": "_" + PT[2] + " %s", "ok": "Sim"}, "Portuguese <translation-team-pt@lists.sourceforge.net>"),
        "usr/share/locale/pt_BR/LC_MESSAGES/coreutils.mo": mo_file({"type the %s": "_" + BR[2] + " %s",
                                                                    "ok": "Sim"}),
        "usr/share/locale/pt/LC_MESSAGES/broken.mo": b"\x00 not a catalog"}, zst=True)
    # a package whose name says nothing: its catalog's header names the translation team
    deb(debs / "someapp_2.0_amd64.deb", {
        "usr/share/locale/pt/LC_MESSAGES/someapp.mo": mo_file({"saved": PT[3]}, "Portuguese <kde-i18n-pt@kde.org>"),
        "usr/share/locale/pt_BR/LC_MESSAGES/someapp.mo": mo_file({"saved": BR[3]}, "Brazilian Portuguese "
                                                                 "<kde-i18n-pt_BR@kde.org>")})
    pairs, summary = build_pairs(sorted(debs.glob("*.deb")))
    got = {(p["source"], p["group"], p["pt-PT"], p["pt-BR"]) for p in pairs}
    assert got == {("help", "libreoffice", PT[0], BR[0]), ("langpack", "mozilla", PT[1], BR[1]),
                   ("mo", "gnu", PT[2], BR[2]), ("mo", "kde", PT[3], BR[3])}, got
    counts = summary["counts"]
    assert counts["help:not_portuguese"] == 1 and counts["help:identical"] == 1 and counts["mo:identical"] == 1
    assert counts["mo:unreadable"] == 1  # counted and left out; the package's other catalogs are kept
    assert summary["packages"]["coreutils"] == "9.1"
    assert (clean_message("<b>_Guardar</b> %(name)s &amp; %1$s {0} ficheiro\\n") == "Guardar & ficheiro"
            and group_of("vlc-l10n", "mo", "Portuguese <pt@li.org>") == "launchpad"
            and group_of("sugar", "mo", "LANGUAGE <LL@li.org>") == "other"  # gettext's template, no team
            and group_of("firefox-esr", "langpack") == "mozilla" and group_of("libreoffice-parlatype", "mo") == "other")

    with pytest.raises(AmaliaError, match="not a Debian package"):
        build_pairs([_not_a_deb(tmp_path)])


def docbook(paragraphs: list[str], credits: list[str]) -> bytes:
    """A KDE handbook page: entities, a comment, a terminal listing and nested paragraphs, translator credits."""
    paras = "".join(f"<para>{p}</para>" for p in paragraphs)
    listing = "<screen><userinput>make install</userinput> # não é prosa</screen>"
    thanks = "".join(f"<para>{c} <email>tradutor@example.org</email></para>" for c in credits)
    return (f'<?xml version="1.0" ?>\n<!-- &kapp; -->\n<book><chapter><title>O &kapp; e o &Linux;</title>{paras}'
            f"<para>Antes da lista: <itemizedlist><listitem><para>{paragraphs[-1]}</para></listitem></itemizedlist>"
            f"</para>{listing}{thanks}</chapter></book>").encode()


def test_a_manuals_paragraphs_pair_by_their_markup_even_where_one_side_has_one_more(tmp_path):
    # KDE's handbook of an application in both varieties (the pt-BR side has a paragraph more at its start and one
    # more translator credit), and a
    # GNOME Mallard page; the package's catalogs name the team the manuals are counted in
    pt_page = [PT[0], f"Carregue em <guibutton>OK</guibutton> 2 vezes: {PT[1]}", PT[3]]
    br_page = ["Este manual foi adaptado para o Brasil pela equipe de tradução.", BR[0],
               f"Clique em <guibutton>OK</guibutton> 2 vezes: {BR[1]}", BR[3]]
    mallard = ('<page xmlns="http://projectmallard.org/1.0/"><title>{}</title><p>{}</p><p><code>ls -l</code> {}</p>'
               "</page>")
    deb(tmp_path / "someapp_2.0_amd64.deb", {
        "usr/share/locale/pt/LC_MESSAGES/someapp.mo": mo_file({"ok": "Sim"}, "Portuguese <kde-i18n-pt@kde.org>"),
        "usr/share/doc/HTML/pt/someapp/index.docbook": docbook(pt_page, ["Tradução de Ana"]),
        "usr/share/doc/HTML/pt_BR/someapp/index.docbook": docbook(br_page, ["Tradução de Bia", "Revisão de Caio"]),
        "usr/share/help/pt/someapp/index.page": mallard.format("Como guardar a sua aplicação", PT[2], PT[1]).encode(),
        "usr/share/help/pt_BR/someapp/index.page": mallard.format("Como salvar o seu aplicativo", BR[2],
                                                                  BR[1]).encode()})
    pairs, summary = build_pairs([tmp_path / "someapp_2.0_amd64.deb"])
    got = [(p["pair"], p["group"], p["pt-PT"], p["pt-BR"]) for p in pairs]
    assert got == [
        ("someapp/doc:doc/HTML/someapp/index.docbook#1", "kde", PT[0], BR[0]),
        ("someapp/doc:doc/HTML/someapp/index.docbook#2", "kde", f"Carregue em OK 2 vezes: {PT[1]}",
         f"Clique em OK 2 vezes: {BR[1]}"),
        ("someapp/doc:doc/HTML/someapp/index.docbook#3", "kde", PT[3], BR[3]),  # again, inside a list: a repeat
        ("someapp/doc:help/someapp/index.page#0", "kde", "Como guardar a sua aplicação",
         "Como salvar o seu aplicativo"),
        ("someapp/doc:help/someapp/index.page#1", "kde", PT[2], BR[2]),
        ("someapp/doc:help/someapp/index.page#2", "kde", PT[1], BR[1])], got
    # the title once its entities are gone ("O e o"), and the credits, emptied on both sides
    assert summary["counts"]["doc:identical"] == 2
    # an unclosed listing or comment drops the rest of the page: nothing of it is read as prose
    assert list(_doc_paragraphs(b"<p>um dois</p><screen><p>rm -rf</p><!-- <p>tr\xc3\xaas</p>").values()) == ["um dois"]
    page = b"<p>um <code/>dois</p><screen>ls <!-- </screen> --> <p>rm</p></screen><CODE>x</CODE><p>tr\xc3\xaas</p>"
    assert [clean_message(p) for p in _doc_paragraphs(page).values()] == ["um dois", "três"]


def _not_a_deb(tmp_path: Path) -> Path:
    (tmp_path / "fake_1_all.deb").write_bytes(b"PK\x03\x04 not an ar archive")
    return tmp_path / "fake_1_all.deb"


def synthetic_pairs(n: int) -> list[dict]:
    """Pairs with the varieties' marks around shared content words: only the marks tell the sides apart."""
    nouns = ["documento", "imagem", "tabela", "mensagem", "pasta", "página", "janela", "conta", "nota", "lista",
             "rede", "senha nova", "cor", "letra", "linha"]
    pairs = []
    for i in range(n):
        noun, other = nouns[i % len(nouns)], nouns[(i * 7 + 3) % len(nouns)]
        pt = [f"O utilizador está a abrir a {noun} e a {other}", f"Não foi possível guardar a {noun} no ficheiro",
              f"Pode-se escolher a {noun} e a {other}", f"Está a descarregar a {noun} do registo"][i % 4]
        br = [f"O usuário está abrindo a {noun} e a {other}", f"Não foi possível salvar a {noun} no arquivo",
              f"Se pode escolher a {noun} e a {other}", f"Está baixando a {noun} do registro"][i % 4]
        pairs.append({"pair": f"p{i}", "group": "gnu" if i % 3 else "gnome", "pt-PT": pt, "pt-BR": br})
    return pairs


def test_a_model_trained_on_pairs_tells_the_varieties_apart_and_loads_as_plain_arrays(tmp_path):
    pairs = synthetic_pairs(240)
    meta = train_variety_model(tmp_path / "m", pairs, exclude_groups=("gnome",), holdout=0.2)
    assert meta["train_pairs_by_group"] == {"gnu": meta["train_pairs"]} and "group:gnome" in meta["measured"]
    held = meta["measured"]["group:gnome"]
    assert held["pairs"] == 80 and held["curve"][0]["pt-PT"]["accuracy"] == 1.0
    assert held["same_content_words"]["pairs"] > 0
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["variety_model.json", "weights.npz"]

    labels, scores = label_texts(["O utilizador está a guardar a imagem no ecrã",
                                  "O usuário está salvando a imagem na tela", "123"], str(tmp_path / "m"), 0.15)
    assert labels[:2] == ["pt-PT", "pt-BR"] and scores[0] > 0.65 > 0.35 > scores[1]
    cues = label_texts(["O utilizador está a guardar a imagem no ecrã"], None, 0.15)
    assert cues[0] == ["pt-PT"]  # no model: the cue scorer

    with np.load(tmp_path / "m" / "weights.npz") as w:
        index, value = w["index"], w["value"]
    np.savez(tmp_path / "m" / "weights.npz", index=index + (1 << 30), value=value)
    with pytest.raises(AmaliaError, match="outside the model's"):
        VarietyModel(tmp_path / "m")
    with pytest.raises(AmaliaError, match="train one with `amalia data train-variety`"):
        VarietyModel(tmp_path / "none")


def test_coverage_and_accuracy_by_margin():
    curve = coverage_accuracy([0.9, 0.6, 0.45, 0.1, 0.55, 0.3], ["pt-PT"] * 3 + ["pt-BR"] * 3, margins=(0.0, 0.15))
    assert curve[0]["pt-PT"] == {"texts": 3, "coverage": 1.0, "accuracy": 0.6667}
    assert curve[1]["pt-PT"] == {"texts": 3, "coverage": 0.3333, "accuracy": 1.0}
    assert curve[1]["pt-BR"] == {"texts": 3, "coverage": 0.6667, "accuracy": 1.0}
    assert smallest_margin(curve, 0.97) == 0.15 and smallest_margin(curve[:1], 0.97) is None
    assert coverage_accuracy([0.5], ["pt-BR"], margins=(0.0,))[0]["pt-BR"]["coverage"] == 0  # no evidence: unknown


def test_the_data_step_and_the_command_tag_with_the_model(tmp_path):
    from amalia_ray.core.config import VarietyConfig
    from amalia_ray.data.steps.language import VarietyTag

    train_variety_model(tmp_path / "m", synthetic_pairs(120), holdout=0.0, label_margin=0.15)
    batch = pa.table({"text": ["O utilizador está a guardar a imagem no ecrã", "O usuário está salvando a imagem",
                               "dropped before"], "drop_reason": [None, None, "too_short"]})
    out = VarietyTag(VarietyConfig(keep=["pt-PT"], model=str(tmp_path / "m")), str(tmp_path / "m"))(batch)
    assert out["pt_variety"].to_pylist() == ["pt-PT", "pt-BR", None]
    assert out["drop_reason"].to_pylist() == [None, "variety:pt-BR", "too_short"]

    runner = CliRunner()
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": BR[0], "id": 7}) + "\n\n" +
                                       json.dumps({"text": PT[0]}) + "\n", encoding="utf-8")
    r = runner.invoke(app, ["data", "variety", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                            "--model", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r.get("id"), r["pt_variety"]) for r in rows] == [(7, "pt-BR"), (None, "pt-PT")]
    (tmp_path / "in.txt").write_text(PT[1] + "\n" + BR[1] + "\n", encoding="utf-8")
    r = runner.invoke(app, ["data", "variety", str(tmp_path / "in.txt"), str(tmp_path / "out2.jsonl")])
    assert r.exit_code == 0 and json.loads(r.output)["texts"] == 2, r.output  # the cue scorer
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    r = runner.invoke(app, ["data", "variety", str(tmp_path / "bad.jsonl"), str(tmp_path / "o3.jsonl")])
    assert r.exit_code != 0 and "bad.jsonl line 2" in r.output


def test_a_large_input_is_tagged_by_ray_data_in_parts(ray_cluster, tmp_path):
    from amalia_ray.data.variety.variety_tagging import tag_file

    train_variety_model(tmp_path / "m", synthetic_pairs(120), holdout=0.0)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in (PT + BR) * 15))
    counts = tag_file(tmp_path / "in.jsonl", tmp_path / "out", tmp_path / "m", 0.15, local_bytes=100)
    assert counts["texts"] == 120 and counts["pt-PT"] + counts["pt-BR"] + counts["unknown"] == 120
    rows = [json.loads(line) for f in sorted((tmp_path / "out").glob("*.json*")) for line in f.read_text().splitlines()]
    assert len(rows) == 120 and {r["pt_variety"] for r in rows} <= {"pt-PT", "pt-BR", "unknown"}


def test_the_pt_variety_reward_and_the_eval_metric_score_with_the_model(tmp_path, monkeypatch):
    import asyncio

    from amalia_ray.core.rewards import get_reward
    from amalia_ray.evals import generate

    train_variety_model(tmp_path / "m", synthetic_pairs(120), holdout=0.0)
    reward = get_reward("pt_variety", str(tmp_path / "m"))
    pt = "<think>…</think><answer>O utilizador está a guardar a imagem no ecrã</answer>"
    br = "<answer>O usuário está salvando a imagem na tela</answer>"
    assert reward(pt, {}) > 0.65 > 0.35 > reward(br, {})
    assert get_reward("pt_variety")(pt, {}) > 0.5  # the cue scorer

    async def fake_generate(client, prompt, **kwargs):
        return "O usuário está salvando a imagem na tela"

    monkeypatch.setattr(generate, "generate", fake_generate)
    item = generate.PromptItem(id="1", prompt="Escreva uma frase.", meta={})
    row = asyncio.run(generate.score_variety_of_generation(None, item, max_tokens=8, chat=False,
                                                          variety_model=str(tmp_path / "m"), variety_margin=0.15))
    assert row["label"] == "pt-BR" and row["pt_br"] == 1.0 and row["pt_pt_score"] < 0.35


def test_a_recipes_variety_models_are_resolved_checked_before_work_and_decide_reruns(tmp_path):
    """`variety.model` (data), `eval.variety.model` and a sampled stage's `variety_model` are paths relative to the
    recipe: resolved before they reach workers or the eval client, loaded by the preflight (a missing one fails
    before any work), and an input of their stages, so a model trained again reruns what scored with it."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline import stages
    from amalia_ray.pipeline.runner import Pipeline
    from tests.conftest import write_recipe

    train_variety_model(tmp_path / "vm", synthetic_pairs(120), holdout=0.0)  # measured on nothing: no margin
    p = Pipeline(load_recipe(write_recipe(tmp_path, **{"eval.variety": {"model": "vm", "margin": 0.2},
                                                       "data.variety.model": "vm", "data.variety.margin": 0.3})))
    settings = stages.with_variety_model(p, p.recipe.eval)
    assert Path(settings.variety.model) == tmp_path / "vm" and settings.variety.margin == 0.2
    assert stages.variety_models(p, p.recipe.eval) == {"variety_model": tmp_path / "vm"}
    p.preflight(until="data")

    p = Pipeline(load_recipe(write_recipe(tmp_path, **{"eval.variety": {"model": "gone"}})))
    with pytest.raises(AmaliaError, match="variety model not found"):
        p.preflight(until="data")
    # labels at the model's own margin, which this one does not record: refused before any work, naming the fix
    p = Pipeline(load_recipe(write_recipe(tmp_path, **{"eval.variety": {"model": "vm"}})))
    with pytest.raises(AmaliaError, match=r"records no label margin .*: set variety.margin"):
        p.preflight(until="data")


def test_the_shipped_model_is_named_builtin_anywhere_a_model_is_and_tells_the_varieties_apart(tmp_path):
    """`builtin` is the model `make variety-model` trained and the repository ships: the recipe resolves it to
    the package's folder (not the recipe's), and it labels unseen sentences of each variety."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.core.variety_model import BUILTIN_FOLDER
    from amalia_ray.pipeline import stages
    from amalia_ray.pipeline.runner import Pipeline
    from tests.conftest import write_recipe

    p = Pipeline(load_recipe(write_recipe(tmp_path, **{"eval.variety": {"model": "builtin"}})))
    assert stages.variety_models(p, p.recipe.eval) == {"variety_model": BUILTIN_FOLDER}
    # workers get the name: each loads its own installed copy (the package's folder differs between nodes)
    assert stages.with_variety_model(p, p.recipe.eval).variety.model == "builtin"
    meta = VarietyModel("builtin").meta
    assert meta["train_pairs"] > 100_000 and {"kde", "gnome", "libreoffice", "mozilla"} <= set(
        meta["train_pairs_by_group"])
    labels, _ = label_texts(["Se quiser guardar o ficheiro, carregue no botão e escolha a pasta no ecrã.",
                             "Se você quiser salvar o arquivo, clique no botão e escolha a pasta na tela."],
                            "builtin", 0.15)
    assert labels == ["pt-PT", "pt-BR"]


def test_a_model_labels_at_its_own_margin_unless_one_is_set(tmp_path):
    """Without a margin set, labels are given at the margin the model records: the smallest >= 97% right on what its
    training held out (teams left out, else a share of its pairs), or one given when it was trained (the shipped
    model's 0.375, measured on unseen teams by bench/variety_accuracy.py); the cue scorer's is 0.15."""
    from amalia_ray.core.config import VarietyConfig
    from amalia_ray.core.variety import CUE_MARGIN
    from amalia_ray.core.variety_model import label_margin

    pairs = synthetic_pairs(240)
    meta = train_variety_model(tmp_path / "share", pairs, holdout=0.2)
    assert meta["margin"] == smallest_margin(meta["measured"]["held_out_pairs"]["curve"], 0.97) is not None
    assert meta["margin_basis"] == "smallest >= 97% right on held_out_pairs"
    teams = train_variety_model(tmp_path / "teams", pairs, exclude_groups=("gnome",), holdout=0.2)
    assert teams["margin"] == smallest_margin(teams["measured"]["group:gnome"]["curve"], 0.97)
    given = train_variety_model(tmp_path / "given", pairs, holdout=0.0, label_margin=0.3)
    assert (given["margin"], given["margin_basis"]) == (0.3, "given (--label-margin)")
    assert label_margin(tmp_path / "given") == 0.3 and label_margin(tmp_path / "given", 0.1) == 0.1
    assert label_margin("builtin") == 0.375 and label_margin(None) == CUE_MARGIN == 0.15
    assert VarietyConfig(model="builtin").margin is None, "the recipe's default: the model's own"
    train_variety_model(tmp_path / "none", pairs, holdout=0.0)  # held nothing out: measured on nothing
    with pytest.raises(AmaliaError, match="records no label margin"):
        label_margin(tmp_path / "none")

    # the command too: at 0.375 the builtin model leaves "Clique no botão…" (P(pt-PT) about 0.26) unlabelled
    texts = ["O ficheiro foi guardado.", "Clique no botão para continuar."]
    scores = pt_pt_scores(texts, "builtin")
    assert scores[0] > 0.875 and 0.125 < scores[1] < 0.35, scores
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    for extra, expected in (([], ["pt-PT", "unknown"]), (["--margin", "0.15"], ["pt-PT", "pt-BR"])):
        r = CliRunner().invoke(app, ["data", "variety", str(tmp_path / "in.txt"), str(tmp_path / "out.jsonl"),
                                     "--model", "builtin", *extra])
        assert r.exit_code == 0, r.output
        rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [row["pt_variety"] for row in rows] == expected


def test_pt_pt_text_in_the_1990_spelling_is_trained_on_as_a_respelled_twin(tmp_path):
    """Portugal's catalogs mostly keep the old spelling ("actual", "seleccione"); the twins teach that "atual" is
    written in Portugal too, so current European text is not read as Brazilian for its spelling alone."""
    pairs = [{"pair": f"a{i}", "group": "g", "pt-PT": f"Seleccione o ficheiro actual do utilizador número {i}",
              "pt-BR": f"Selecione o arquivo atual do usuário número {i}"} for i in range(40)]
    pairs += [{"pair": f"b{i}", "group": "g", "pt-PT": f"Selecione a definição atual do utilizador {i}",
               "pt-BR": f"Selecione a configuração atual do usuário {i}"} for i in range(5)]
    pairs += [{"pair": f"c{i}", "group": "g", "pt-PT": f"De facto, o ficheiro {i} está no ecrã",
               "pt-BR": f"De fato, o arquivo {i} está na tela"} for i in range(30)]
    pt_texts = [p["pt-PT"] for p in pairs]
    # the new forms are written on the pt-PT side 5 times to the old ones' 40; "fato" is not written there at all
    assert reform_respellings(pt_texts) == {"actual": "atual", "seleccione": "selecione"}
    assert (respelled(["ACTUAL: Actual, pode-se ver o actual"], {"actual": "atual"})
            == ["ATUAL: Atual, pode-se ver o atual"])
    assert respelled(["actoſ"], {"actos": "atos"}) == ["actoſ"]  # matched ignoring case, but no key of the mapping

    with_twins = train_variety_model(tmp_path / "twins", pairs, holdout=0.0)
    without = train_variety_model(tmp_path / "plain", pairs, holdout=0.0, respell_reform=False)
    assert with_twins["respelled_pt_twins"] == 40 and without["respelled_pt_twins"] == 0
    texts = ["atual", "O ficheiro atual"]  # the new spelling weighs less towards pt-BR with the twins
    plain, twins = VarietyModel(tmp_path / "plain").score(texts), VarietyModel(tmp_path / "twins").score(texts)
    assert (twins > plain + 0.04).all(), (plain, twins)
