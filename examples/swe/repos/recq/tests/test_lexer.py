import pytest

from recq import QuerySyntaxError, decode_string, tokenize


def kinds_and_values(text):
    return [(t.kind, t.value) for t in tokenize(text)]


def test_tokenize_simple_comparison():
    assert kinds_and_values("age >= 30") == [
        ("name", "age"),
        ("op", ">="),
        ("number", 30),
        ("end", None),
    ]


def test_tokenize_numbers_keep_their_type():
    tokens = tokenize("a < -3.5 or b = 42")
    assert tokens[2].value == -3.5 and isinstance(tokens[2].value, float)
    assert tokens[6].value == 42 and isinstance(tokens[6].value, int)


def test_tokenize_all_operators():
    ops = [t.value for t in tokenize("a != 1 <= 2 >= 3 = 4 < 5 > 6 ~ 7") if t.kind == "op"]
    assert ops == ["!=", "<=", ">=", "=", "<", ">", "~"]


def test_tokenize_keywords_are_case_insensitive():
    tokens = tokenize("a = 1 AND Not b In [true, NULL]")
    keywords = [t.value for t in tokens if t.kind == "keyword"]
    assert keywords == ["and", "not", "in", "true", "null"]


def test_tokenize_names_containing_keywords_stay_names():
    tokens = tokenize("android = 1 or order.notes = 2")
    assert tokens[0].kind == "name" and tokens[0].value == "android"
    assert tokens[4].kind == "name" and tokens[4].value == "order.notes", "dotted path"


def test_tokenize_positions():
    assert [t.pos for t in tokenize("a = 'x'")] == [0, 2, 4, 7]


def test_tokenize_strings_both_quotes():
    tokens = tokenize("""a = 'it\\'s' or b = "say \\"hi\\"" """)
    assert tokens[2].value == "it's"
    assert tokens[6].value == 'say "hi"'


def test_tokenize_punctuation():
    kinds = [t.kind for t in tokenize("(x in [1, 2])")]
    assert kinds == ["punct", "name", "keyword", "punct", "number", "punct", "number",
                     "punct", "punct", "end"]


def test_decode_string_escapes():
    assert decode_string("'a\\nb\\tc'") == "a\nb\tc"
    assert decode_string("'back\\\\slash'") == "back\\slash"
    assert decode_string("'keep \\q'") == "keep \\q", "unknown escapes are kept"
    assert decode_string("''") == ""


def test_tokenize_rejects_unknown_character_inside():
    with pytest.raises(QuerySyntaxError) as info:
        tokenize("a $ b")
    assert info.value.pos == 2
    assert "at position 2" in str(info.value)


def test_tokenize_rejects_unknown_character_at_end():
    with pytest.raises(QuerySyntaxError) as info:
        tokenize("a = 1 #")
    assert info.value.pos == 6


def test_tokenize_rejects_unterminated_string():
    with pytest.raises(QuerySyntaxError) as info:
        tokenize("name = 'abc")
    assert info.value.pos == 7
