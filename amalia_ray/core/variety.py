"""European (pt-PT) vs Brazilian (pt-BR) Portuguese: a transparent cue-based scorer.

Language-ID models (fastText lid.176, langid) say "pt" for both. The two varieties differ in vocabulary (equipa /
equipe, ecrã / tela, autocarro / ônibus), spelling (pre-reform "facto", "acção", "óptimo"; acute vs circumflex in
"económico" / "econômico"), progressive aspect ("estou a fazer" / "estou fazendo") and clitic placement ("chama-se" /
"se chama" at the start of a sentence). Each cue found adds its weight to one side; the score is the pt-PT share of
the evidence, smoothed so that a text without cues scores 0.5 (unknown).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (pt-PT form, pt-BR form) pairs of words or phrases; each side is a cue for its variety.
LEXICAL_PAIRS = [
    ("equipa", "equipe"), ("ecrã", "tela"), ("autocarro", "ônibus"), ("comboio", "trem"), ("telemóvel", "celular"),
    ("pequeno-almoço", "café da manhã"), ("casa de banho", "banheiro"), ("rapariga", "moça"), ("miúdo", "garoto"),
    ("frigorífico", "geladeira"), ("sumo", "suco"), ("chávena", "xícara"), ("utilizador", "usuário"),
    ("utilizadores", "usuários"), ("registo", "registro"), ("registos", "registros"), ("contacto", "contato"),
    ("contactos", "contatos"), ("palavra-passe", "senha"), ("folha de cálculo", "planilha"), ("camião", "caminhão"),
    # acute (pt-PT) vs circumflex (pt-BR) before m/n: both spellings are current, each in its own variety
    ("económico", "econômico"), ("económica", "econômica"), ("académico", "acadêmico"), ("género", "gênero"),
    ("fenómeno", "fenômeno"), ("António", "Antônio"), ("ténis", "tênis"), ("bebé", "bebê"), ("cómodo", "cômodo"),
    ("anónimo", "anônimo"), ("sinónimo", "sinônimo"), ("polémica", "polêmica"), ("efémero", "efêmero"),
    ("electrónico", "eletrônico"), ("eletrónico", "eletrônico"), ("electrónica", "eletrônica"),
    ("eletrónica", "eletrônica"), ("quilómetro", "quilômetro"), ("tónico", "tônico"), ("prémio", "prêmio"),
    ("génio", "gênio"), ("ómega", "ômega"), ("síndroma", "síndrome"), ("ficheiro", "arquivo de computador"),
    ("desporto", "esporte"), ("desportos", "esportes"), ("desportivo", "esportivo"), ("golo", "gol"),
    ("guarda-redes", "goleiro"), ("treino", "treinamento"), ("canadiano", "canadense"), ("iraniano", "iraniense"),
    ("propinas", "mensalidades"), ("secretária de trabalho", "escrivaninha"), ("metro de Lisboa", "metrô"),
]

# Only one side is a cue: pt-PT kept the silent consonants until the 1990 agreement (in force in Portugal from
# 2009), Brazil dropped them in 1943, so "facto", "acção", "óptimo" mark pt-PT while "ação", "ótimo" are now both.
PT_EXTRA = [
    "facto", "factos", "actual", "actualmente", "actualizar", "actualização", "acção", "acções", "direcção",
    "selecção", "projecto", "projectos", "objecto", "objectos", "óptimo", "excepção", "eléctrico", "colecção",
    "correcto", "director", "efectivamente", "arquitectura", "adoptar", "baptismo", "actos", "protecção",
    "ficheiros", "vós", "convosco", "bocado", "porreiro", "rebuçado", "montra", "talho", "fixe", "bué",
    "descarregar", "portátil", "sítio web", "telemóveis",
]
BR_EXTRA = ["a gente", "cadastro", "cadastrar", "aplicativo", "deletar", "sorvete", "gostoso", "bacana", "moleque",
            "legal pra", "pra você", "tá", "né", "cê"]

PROGRESSIVE_PT = re.compile(
    r"\b(?:estou|estás|está|estamos|estão|estava|estavas|estávamos|estavam|estive|esteve|estar|ficou|ficam|"
    r"continua|continuam|anda|andam)\s+a\s+\w+(?:ar|er|ir)\b", re.IGNORECASE)
PROGRESSIVE_BR = re.compile(
    r"\b(?:estou|estás|está|estamos|estão|estava|estavas|estávamos|estavam|estive|esteve|estar|ficou|ficam|"
    r"continua|continuam|anda|andam)\s+\w+(?:ando|endo|indo)\b", re.IGNORECASE)
# "se" and "nos" are left out: sentence-initial "Se" is mostly the conjunction "if", "Nos" the contraction "in the"
CLITIC_INITIAL_BR = re.compile(r"(?:^|[.!?]\s+)(?:me|te|lhe)\s+\w+", re.IGNORECASE)
# pt-BR drops the article before possessives ("Minha casa") and after singular todo/toda meaning "every"
# ("toda pessoa"); pt-PT keeps both ("A minha casa", "toda a pessoa").
BARE_POSSESSIVE_BR = re.compile(r"(?:^|[.!?:;]\s+)(?:meu|minha|meus|minhas|nosso|nossa|nossos|nossas)\s+\w+",
                                re.IGNORECASE)
ARTICLE_POSSESSIVE_PT = re.compile(r"(?:^|[.!?:;]\s+)(?:o|a|os|as)\s+(?:meu|minha|meus|minhas|nosso|nossa|nossos|"
                                   r"nossas)\s+\w+", re.IGNORECASE)
BARE_TODO_BR = re.compile(r"\btod[oa]\s+(?!o\b|a\b|um\b|uma\b|ele\b|ela\b|este\b|esta\b|esse\b|essa\b|aquele\b|"
                          r"aquela\b|isso\b|isto\b|o\s)[a-záéíóúâêôãõç]+", re.IGNORECASE)
TODO_ARTICLE_PT = re.compile(r"\btoda\s+a\s+(?:pessoa|gente|criança|mulher|sociedade)\b|\btodo\s+o\s+(?:homem|"
                             r"indivíduo|cidadão|ser)\b", re.IGNORECASE)
CLITIC_ENCLITIC_PT = re.compile(r"\b\w{3,}-(?:me|te|se|lhe|lhes|nos|vos|lo|la|los|las)\b", re.IGNORECASE)


def _phrase_pattern(phrases: list[str]) -> re.Pattern:
    alternatives = sorted({re.escape(p) for p in phrases}, key=len, reverse=True)
    return re.compile(r"(?<!\w)(?:" + "|".join(alternatives) + r")(?!\w)", re.IGNORECASE)


_PT_WORDS = _phrase_pattern([pt for pt, br in LEXICAL_PAIRS if pt.lower() != br.lower()] + PT_EXTRA)
_BR_WORDS = _phrase_pattern([br for pt, br in LEXICAL_PAIRS if pt.lower() != br.lower()] + BR_EXTRA)


# how far from 0.5 the cue scorer's share must be for a label: a model records its own (variety_model.json `margin`)
CUE_MARGIN = 0.15


@dataclass(frozen=True)
class VarietyScore:
    pt_pt: float  # share of pt-PT evidence in [0, 1]; 0.5 = none either way
    pt_cues: float
    br_cues: float

    def label(self, margin: float = CUE_MARGIN) -> str:
        return variety_label(self.pt_pt, margin)


def variety_label(pt_pt: float, margin: float) -> str:
    """pt-PT / pt-BR when a pt-PT score (the cue scorer's share or a model's probability) is at least `margin`
    away from 0.5 on its side, else unknown."""
    if pt_pt >= 0.5 + margin:
        return "pt-PT"
    if pt_pt <= 0.5 - margin:
        return "pt-BR"
    return "unknown"


def score_variety(text: str, smoothing: float = 1.0) -> VarietyScore:
    pt = (len(_PT_WORDS.findall(text)) + 2 * len(PROGRESSIVE_PT.findall(text))
          + 0.5 * len(CLITIC_ENCLITIC_PT.findall(text)) + len(ARTICLE_POSSESSIVE_PT.findall(text))
          + len(TODO_ARTICLE_PT.findall(text)))
    br = (len(_BR_WORDS.findall(text)) + 2 * len(PROGRESSIVE_BR.findall(text)) + len(CLITIC_INITIAL_BR.findall(text))
          + len(BARE_POSSESSIVE_BR.findall(text)) + len(BARE_TODO_BR.findall(text)))
    return VarietyScore((pt + smoothing) / (pt + br + 2 * smoothing), pt, br)
