"""Which chat template the tokenizer renders: tokenizer_config.json's, or a chat_template.jinja beside it."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from tests.conftest import write_byte_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_config_template_renders_without_a_template_file(tmp_path):
    write_byte_tokenizer(tmp_path)
    assert "hi" in Tokenizer(tmp_path).apply_chat_template(MESSAGES)


def test_a_chat_template_file_wins_over_the_config_template(tmp_path):
    # A deployment replaces a template the renderer cannot take (llava-1.5's list-content one) with a file.
    write_byte_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'].upper() }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    assert Tokenizer(tmp_path).apply_chat_template(MESSAGES) == "USER: hi ASSISTANT:"
