"""How the ASR handler appends a corrected chunk: without restating the transcript, capitalized after a sentence."""

from __future__ import annotations

import pytest

from worker.handlers.asr import capitalize_after_sentence, drop_repeated_context, keeps_the_chunk

CASES = [
    # The model restated the last sentence before correcting the chunk (seen in the demo with SmolLM2).
    ("The meeting is moved to Tuesday.", "The meeting is moved to Tuesday at ten thirty in the main conference room.",
     "at ten thirty in the main conference room", "at ten thirty in the main conference room."),
    # Case and punctuation do not hide the overlap; the separator after it goes too.
    ("so, the budget is approved.", "The budget is approved, and the hiring freeze ends.",
     "and the hiring freeze ends", "and the hiring freeze ends."),
    # No overlap: unchanged.
    ("Hello there.", "How are you today?", "how are you today", "How are you today?"),
    # The speaker repeated themselves: the raw chunk starts with the same words, so they stay.
    ("Thank you.", "Thank you again for coming.", "thank you again for coming", "Thank you again for coming."),
    # Nothing but the restatement: empty (the handler then falls back to the raw chunk).
    ("We start at nine.", "We start at nine.", "uh yeah", ""),
    # First chunk of a stream: nothing committed yet.
    ("", "Good morning everyone.", "good morning everyone", "Good morning everyone."),
    # Only a suffix of the committed text is restated.
    ("Alice called. She will be late", "she will be late by ten minutes", "by ten minutes", "by ten minutes"),
]


@pytest.mark.parametrize(("committed", "corrected", "chunk", "expected"), CASES)
def test_drop_repeated_context(committed, corrected, chunk, expected):
    assert drop_repeated_context(committed, corrected, chunk) == expected


@pytest.mark.parametrize(("committed", "corrected", "expected"), [
    ("The meeting is moved to Tuesday.", "at ten thirty.", "At ten thirty."),
    ("Is it Tuesday? ", "yes it is.", "Yes it is."),
    ("The meeting is moved to Tuesday", "at ten thirty.", "at ten thirty."),  # mid-sentence: as it is
    ("Done.", "3 items left.", "3 items left."),  # nothing to capitalize
    ("Done.", "", ""),
    ("", "good morning.", "good morning."),  # the first chunk is the model's business
])
def test_capitalize_after_sentence(committed, corrected, expected):
    assert capitalize_after_sentence(committed, corrected) == expected


@pytest.mark.parametrize(("corrected", "chunk", "kept"), [
    ("Okay, so the thing is...", "okay so the thing is", True),
    ("Tuesday.", "tuesday", True),  # case and punctuation are the correction
    # Answers seen from SmolLM2 for short chunks: the instruction, or a remark; they share no word with the chunk.
    ("Rewrite this speech transcript with correct capitalization and punctuation.", "first", False),
    ("The speech transcript is:", "yeah", False),
    ("Rewrite this speech transcript with correct capitalization and punctuation.", "", False),
    ("", "", True),  # a silent chunk stays silent
    ("", "um", False),  # an empty answer to words: the words as heard
    # The instruction's own words, even where the chunk shares one of them.
    ("Rewrite this speech transcript with correct capitalization.", "the speech went well", False),
])
def test_keeps_the_chunk(corrected, chunk, kept):
    assert keeps_the_chunk(corrected, chunk) is kept
