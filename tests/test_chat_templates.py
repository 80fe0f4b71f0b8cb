"""`kvcli chat` on the architectures users run, each through its own chat template (issue #29, item 4): tiny
random-weight GGUFs of each architecture carrying the template their real files carry in
`tokenizer.chat_template` (Gemma 3, Gemma 2, Qwen3, Phi-3), chatted with through a pipe for two turns with a
system prompt. Each turn's prompt must be exactly the template's rendering of the conversation so far, as the
model's own format spells it (written out by hand below, not asked of the template), and Gemma 2's template,
which raises on a system message, gets the system prompt at the head of the first user message instead of a
refused conversation. The replies themselves are random text (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kquant_model import write_tiny_kquant_gguf
from test_chat import assert_clean, chat, status_lines

pytestmark = pytest.mark.slow

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def gemma(system: str, turns: list[tuple[str, str | None]], bos: str, inline: bool) -> str:
    """Gemma's format: the system prompt opens the first user turn (Gemma 3's template does it; kvcli does it
    for Gemma 2's, which has no system role), roles user / model."""
    out = bos
    for i, (user, reply) in enumerate(turns):
        out += f"<start_of_turn>user\n{system + chr(10) * 2 if i == 0 else ''}{user}<end_of_turn>\n<start_of_turn>model\n"
        if reply is not None:
            out += f"{reply.strip()}<end_of_turn>\n"
    return out


def chatml(system: str, turns: list[tuple[str, str | None]], bos: str, inline: bool) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n"
    for user, reply in turns:
        out += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if reply is not None:
            out += f"{reply}<|im_end|>\n"
    return out


def phi3(system: str, turns: list[tuple[str, str | None]], bos: str, inline: bool) -> str:
    out = f"<|system|>\n{system}<|end|>\n"
    for user, reply in turns:
        out += f"<|user|>\n{user}<|end|>\n<|assistant|>\n"
        if reply is not None:
            out += f"{reply}<|end|>\n"
    return out


CASES = {  # name: (architecture of the file, its template, the format written out, system prompt inline)
    "gemma3": ("gemma3", GEMMA3, gemma, False),
    "gemma2": ("gemma2", GEMMA2, gemma, True),
    "qwen3": ("qwen3", QWEN3, chatml, False),
    "phi3": ("llama", PHI3, phi3, False),  # Phi-3's template on the tiny K-quant llama (the template is the point)
}


@pytest.mark.parametrize("name", list(CASES))
def test_chat_renders_each_architectures_own_template(name, tmp_path):
    import gguf

    from kvcli.model.loader import load_tokenizer

    arch, template, expected, inline = CASES[name]
    path = write_tiny_kquant_gguf(tmp_path / f"{name}.gguf", arch=arch, chat_template=template)
    saved = tmp_path / "chat.json"
    system = "Answer in one word."
    p = chat(["Name a colour.", "And a fruit?", f"/save {saved}"], "--model", str(path), "--system", system,
             "--temperature", "0", "--max-tokens", "6")
    assert p.returncode == 0, p.stderr
    assert_clean(p)
    assert len(status_lines(p.stderr)) == 2, p.stderr
    assert ("no system role" in p.stderr) == inline, p.stderr
    data = json.loads(saved.read_text(encoding="utf-8"))
    replies = [m["content"] for m in data["messages"][1::2]]
    users = [m["content"] for m in data["messages"][0::2]]
    assert users == ["Name a colour.", "And a fruit?"] and data["system"] == system
    tok = load_tokenizer(str(path))
    fields = gguf.GGUFReader(str(path), "r").fields
    bos = str(fields["tokenizer.ggml.tokens"].contents()[int(fields["tokenizer.ggml.bos_token_id"].contents())])
    for i, turn in enumerate(data["turns"]):
        history = [(users[j], replies[j]) for j in range(i)] + [(users[i], None)]
        want = expected(system, history, bos, inline)
        # What chat submitted is the template's rendering of the conversation, token for token.
        assert turn["prompt_tokens"] == len(tok.encode(want)), (name, i, want)


def test_serve_folds_a_system_message_for_a_template_without_one(tmp_path):
    """serve's chat prompts: Gemma 2's template raises on a system message; the prompt is the template's rendering
    with the system text at the head of the first user message (as chat, and llama.cpp's server); a template
    that refuses the conversation anyway (roles out of order) is a one-line PromptError."""
    from kvcli.model.loader import load_tokenizer
    from kvcli.server.prompts import PromptEncoder, PromptError

    path = write_tiny_kquant_gguf(tmp_path / "g2.gguf", arch="gemma2", chat_template=GEMMA2)
    tok = load_tokenizer(str(path))
    enc = PromptEncoder(tok, 512)
    ids = enc.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert ids == tok.apply_chat_template([{"role": "user", "content": "Be brief.\n\nHi"}])
    with pytest.raises(PromptError, match="roles must alternate"):
        enc.chat([{"role": "assistant", "content": "x"}, {"role": "user", "content": "Hi"}])
