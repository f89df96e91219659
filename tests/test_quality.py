import pyarrow as pa
import pytest

from amalia_ray.core.config import FineWebConfig, GopherQualityConfig, GopherRepetitionConfig, QualityConfig
from amalia_ray.data.steps.quality import (
    duplicated_ngram_fraction,
    fineweb_reason,
    gopher_quality_reason,
    gopher_repetition_reason,
    quality_steps,
    top_ngram_fraction,
)

# written for this test: ordinary European-Portuguese prose, five sentences, one per line
GOOD = (
    "A biblioteca municipal abriu hoje uma nova sala de leitura para os mais novos, com livros ilustrados e jogos.\n"
    "Os responsáveis explicaram que o espaço foi pensado para as famílias que procuram um lugar calmo ao fim da tarde.\n"
    "Durante a semana haverá sessões de contos, oficinas de escrita e visitas das escolas do concelho.\n"
    "A entrada é gratuita, mas as oficinas exigem inscrição prévia no balcão de atendimento ou pelo telefone.\n"
    "A autarquia espera que a iniciativa aproxime os leitores jovens dos autores portugueses contemporâneos."
)


def test_good_text_passes_every_rule():
    assert gopher_quality_reason(GOOD, GopherQualityConfig(), "pt") is None
    assert gopher_repetition_reason(GOOD, GopherRepetitionConfig()) is None
    assert fineweb_reason(GOOD, FineWebConfig()) is None


def test_gopher_quality_rules():
    cfg = GopherQualityConfig()
    assert gopher_quality_reason("Olá a todos.", cfg, "pt") == "min_doc_words"
    english = " ".join(["Quick brown foxes jump over lazy dogs near rivers today."] * 8)
    assert gopher_quality_reason(english, cfg, "pt") == "stop_words"
    assert gopher_quality_reason(GOOD + " " + "# " * 60, cfg, "pt") == "symbol_word_ratio"
    numbers = " ".join(str(1000 + i) for i in range(80))
    assert gopher_quality_reason(numbers, cfg, "pt") in {"alpha_words_ratio", "avg_word_length"}


def test_gopher_repetition_rules():
    cfg = GopherRepetitionConfig()
    repeated = "\n".join(["Compre já o seu bilhete para o concerto de sábado!"] * 5 + GOOD.split("\n"))
    assert gopher_repetition_reason(repeated, cfg) in {"dup_line_frac", "dup_line_char_frac"}
    looping = " ".join(["o gato"] * 60)
    assert gopher_repetition_reason(looping, cfg) == "top_2_gram"


def test_ngram_fractions():
    words = "a b c a b c".split()
    assert top_ngram_fraction(words, 2) == pytest.approx(4 / 6)
    assert duplicated_ngram_fraction(words, 3) == pytest.approx(1.0)
    assert duplicated_ngram_fraction("a b c d e f".split(), 3) == 0.0


def test_fineweb_rules():
    cfg = FineWebConfig()
    no_punct = "\n".join(line.rstrip(".") for line in GOOD.split("\n"))
    assert fineweb_reason(no_punct, cfg) == "line_punct_ratio"
    short_lines = "\n".join(w + "." for w in GOOD.split())
    assert fineweb_reason(short_lines, cfg) == "short_line_ratio"


def test_steps_record_the_rule_and_respect_earlier_drops():
    batch = pa.table({"text": [GOOD, "Olá.", " ".join(["o gato"] * 60)],
                      "drop_reason": pa.array([None, None, "min_chars"], pa.string())})
    for step in quality_steps(QualityConfig()):
        batch = step(batch)
    assert batch["drop_reason"].to_pylist() == [None, "gopher_quality:min_doc_words", "min_chars"]


def test_disabled_filters_are_skipped():
    cfg = QualityConfig(gopher_quality={"enabled": False}, fineweb={"enabled": False})
    assert [s.name for s in quality_steps(cfg)] == ["gopher_repetition"]
    assert quality_steps(None) == []
