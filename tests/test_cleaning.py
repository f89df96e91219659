import pyarrow as pa
import pytest

from amalia_ray.core.config import CleaningConfig
from amalia_ray.data.steps.cleaning import Clean, remove_repeated_lines, scrub_pii


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Escreva para joana.silva+lista@exemplo.pt hoje.", "Escreva para <EMAIL> hoje."),
        ("Ligue +351 912 345 678 ou 213 456 789.", "Ligue <PHONE> ou <PHONE>."),
        ("Telefone: +55 (11) 91234-5678", "Telefone: <PHONE>"),
        ("O servidor 192.168.1.254 responde.", "O servidor <IP_ADDRESS> responde."),
        ("Endereço 2001:db8:85a3::8a2e:370:7334 e ::1", "Endereço <IP_ADDRESS> e <IP_ADDRESS>"),
    ],
)
def test_pii_is_replaced_by_placeholders(text, expected):
    assert scrub_pii(text) == expected


@pytest.mark.parametrize("text", ["Em 1974 havia 9 milhões de habitantes.", "versão 2.60.0 do Ray", "ISBN 978-972-0",
                                  "Às 10:30:00 em std::vector"])
def test_ordinary_numbers_are_kept(text):
    assert scrub_pii(text) == text


def test_repeated_lines_keep_first_and_short_lines():
    text = "Partilhar no Facebook e no X\nTexto A.\n}\nPartilhar no Facebook e no X\n}\nTexto B."
    assert remove_repeated_lines(text, 20) == "Partilhar no Facebook e no X\nTexto A.\n}\n}\nTexto B."


def test_clean_step_repairs_mojibake():
    batch = pa.table({"id": ["d"], "text": ["InformaÃ§Ã£o: contacte admin@exemplo.pt"]})
    out = Clean(CleaningConfig())(batch)
    assert out["text"].to_pylist() == ["Informação: contacte <EMAIL>"]
    kept = Clean(CleaningConfig(fix_mojibake=False, scrub_pii=False))(batch)
    assert kept["text"].to_pylist() == batch["text"].to_pylist()


def test_ftfy_is_skipped_only_where_it_would_change_nothing():
    import ftfy

    texts = ["InformaÃ§Ã£o sobre o sistema", "nÃ£o Ã© possÃ\xadvel", "“aspas” &amp; ﬁm", "texto\x07 limpo",
             "Ação, coração e pôr do sol: nº 3 «citação» — fim…", "plain ascii text"]
    cfg = CleaningConfig(remove_repeated_lines=False, scrub_pii=False)
    out = Clean(cfg)(pa.table({"id": [str(i) for i in range(len(texts))], "text": texts}))["text"].to_pylist()
    assert out == [ftfy.fix_text(t, normalization="NFC") for t in texts]
    assert out[0] == "Informação sobre o sistema" and out[4] == texts[4]


@pytest.mark.parametrize("text", ["a:" * 6000 + "g", "a." * 200_000, "x@y." * 50_000])
def test_a_long_run_shaped_like_an_address_is_scanned_in_linear_time(text):
    """Unbounded repeats in the e-mail and IPv6 patterns backtracked in quadratic and cubic time: the first of these
    took minutes. Run in a thread so that a regression fails here instead of hanging the suite."""
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.append(scrub_pii(text)), daemon=True)
    worker.start()
    worker.join(60)
    assert out == [text], "still scanning after 60 s (a minute for what takes milliseconds)"
