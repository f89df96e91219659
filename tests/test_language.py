import pyarrow as pa

from amalia_ray.core.config import LanguageConfig, VarietyConfig
from amalia_ray.data.steps.language import LanguageID, VarietyTag, detect_language
from amalia_ray.core.variety import score_variety

# sentences written for these tests
PT_PT = ("A equipa técnica esteve a analisar o ecrã do telemóvel durante o pequeno-almoço e, de facto, "
         "encontrou o problema no ficheiro de registo do utilizador.")
PT_BR = ("A equipe técnica estava analisando a tela do celular durante o café da manhã e encontrou o problema "
         "no registro do usuário, que tinha cadastrado uma senha errada no aplicativo.")
NEUTRAL = "O sistema guarda os dados num disco e mostra uma mensagem quando a operação termina."
ENGLISH = "The package manager installs software from the configured repositories and resolves dependencies."


def test_variety_scorer_on_written_examples():
    assert score_variety(PT_PT).label() == "pt-PT"
    assert score_variety(PT_BR).label() == "pt-BR"
    neutral = score_variety(NEUTRAL)
    assert neutral.label() == "unknown" and neutral.pt_pt == 0.5


def test_variety_cues_progressive_and_clitics():
    assert score_variety("Ela está a trabalhar e eu estou a estudar.").label() == "pt-PT"
    assert score_variety("Ela está trabalhando e eu estou estudando.").label() == "pt-BR"


def test_language_id_is_offline_and_right():
    assert detect_language(PT_PT)[0] == "pt"
    assert detect_language(ENGLISH)[0] == "en"
    assert detect_language("   ") == ("und", 0.0)


def test_steps_tag_and_drop_by_policy():
    batch = pa.table({"text": [PT_PT, PT_BR, ENGLISH]})
    batch = LanguageID(LanguageConfig(keep=["pt"], min_score=0.5))(batch)
    assert batch["language"].to_pylist() == ["pt", "pt", "en"]
    assert batch["drop_reason"].to_pylist() == [None, None, "language:en"]
    batch = VarietyTag(VarietyConfig(keep=["pt-PT", "unknown"]))(batch)
    assert batch["pt_variety"].to_pylist()[:2] == ["pt-PT", "pt-BR"]
    assert batch["drop_reason"].to_pylist() == [None, "variety:pt-BR", "language:en"]


def test_variety_cues_articles():
    assert score_variety("Toda a pessoa tem direito à educação. A minha família concorda.").label() == "pt-PT"
    assert score_variety("Toda pessoa tem direito à educação. Minha família concorda.").label() == "pt-BR"
