"""Stopping and the streamed text at their boundaries (stopping.py), on a byte-level toy tokenizer: a character whose
UTF-8 bytes are split across tokens, a stop string completed by the last allowed token."""
from osd.stopping import StopChecker


class ByteTokenizer:
    """Token i = the bytes pieces[i]; decode joins them and replaces what is not UTF-8, as a byte-level BPE does."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


PIECES = [b"a", "中".encode()[:2], "中".encode()[2:], b"b", "😀".encode()[:1], "😀".encode()[1:], b"<eos>"]


def streamed(checker: StopChecker, steps: list[list[int]]) -> list[str]:
    """What the scheduler streams (schedule/scheduler.py _commit): the growth of stable_text after each step."""
    sent, out = "", []
    for emitted in steps:
        checker.extend(emitted)
        text = checker.stable_text()
        if len(text) > len(sent):
            out.append(text[len(sent):])
            sent = text
        if checker.finish_reason:
            break
    return out


def test_a_character_split_across_tokens_is_held_until_complete_then_sent_whole():
    checker = StopChecker(ByteTokenizer(PIECES), eos_ids={6}, max_new_tokens=20, stop=[])
    assert streamed(checker, [[0, 1], [2, 3], [4], [5], [6]]) == ["a", "中b", "😀"]
    assert checker.text == "a中b😀" and checker.finish_reason == "stop"


def test_a_character_cut_by_the_length_limit_is_streamed_as_the_final_text_has_it():
    """The limit cuts a character in two: the final text ends in U+FFFD, and so does the stream (equal to it)."""
    checker = StopChecker(ByteTokenizer(PIECES), eos_ids={6}, max_new_tokens=2, stop=[])
    assert "".join(streamed(checker, [[0], [1], [2]])) == checker.text == "a\ufffd"
    assert checker.finish_reason == "length"


def test_a_stop_string_completed_by_the_last_allowed_token_stops_and_is_cut():
    """The max_new_tokens-th token completes a stop string: "stop", and the text is cut before it (OpenAI, vLLM)."""
    for max_new_tokens in (3, 4):  # the stop string's last token is the last allowed one, or one before it
        checker = StopChecker(ByteTokenizer(PIECES), eos_ids={6}, max_new_tokens=max_new_tokens, stop=["中"])
        assert streamed(checker, [[0, 1, 2, 3]]) == ["a"]
        assert (checker.text, checker.finish_reason) == ("a", "stop")
    short = StopChecker(ByteTokenizer(PIECES), eos_ids={6}, max_new_tokens=2, stop=["中"])
    assert short.extend([0, 1, 2, 3]) == "length" and short.text == "a\ufffd"  # one token short of the stop string


class CleaningTokenizer(ByteTokenizer):
    """Hugging Face's clean-up of tokenization spaces, on by default as in SmolLM2's tokenizer."""

    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        text = super().decode(ids)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return text.replace(" n't", "n't").replace(" ,", ",") if clean else text


def test_the_text_is_the_models_own_and_its_stream_joins_into_it_whatever_the_tokenizers_clean_up():
    """A clean-up that rewrites " n't" as "n't" would make "do n" (streamed) + "'t" differ from the answer "don't";
    the text is the model's own ("do n't ,"), streamed and final alike."""
    checker = StopChecker(CleaningTokenizer([b"do", b" n", b"'t", b" ,", b"<eos>"]), eos_ids={4}, max_new_tokens=20,
                          stop=[])
    assert "".join(streamed(checker, [[0], [1], [2], [3], [4]])) == checker.text == "do n't ,"
