"""The ASR handler drops a corrected chunk's restatement of the transcript so far."""

from __future__ import annotations

import pytest

from worker.handlers.asr import drop_repeated_context

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
