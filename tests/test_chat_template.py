"""A model's own chat template (qspec/chat_template.py): rendered as transformers renders it, its errors one
ChatTemplateError naming the problem, and Tokenizer.apply_chat_template using a file's template that is not qspec's."""

from __future__ import annotations

import gguf
import pytest

from qspec.chat_template import ChatTemplateError, compiled, render
from qspec.loader import load_tokenizer
from qspec.tokenizer import QWEN_CHAT_TEMPLATE, Tokenizer
from tests.conftest import tiny_tokenizer

# A Qwen3-style template written for these tests: a namespace, `continue`, string methods, reasoning split off an
# assistant reply and kept only after the last user turn, tools through `tojson`, bos/eos tokens, enable_thinking.
THINKING_TEMPLATE = """{{- bos_token }}
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- set content = m.content if m.content is string else '' %}
{%- if m.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if m.reasoning_content is string %}{% set reasoning = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
<|im_start|>assistant
{% if loop.index0 > ns.last_user and reasoning %}<think>
{{ reasoning }}
</think>

{% endif %}{{ content }}
{%- for call in m.tool_calls or [] %}

<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson(sort_keys=true) }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}
<|im_start|>{{ m.role }}
{{ content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
{{- eos_token if not add_generation_prompt else '' }}"""

PARAMETERS = {"type": "object", "properties": {"ort": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "wetter", "description": "Wetter für eine Stadt",
                                           "parameters": PARAMETERS}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "wetter", "arguments": {"ort": "Köln"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"}, {"role": "user", "content": "U2"}],
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": "", "reasoning_content": "r",
                                        "tool_calls": [CALL]}, {"role": "tool", "content": "12 Grad"}],
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": "<think>\nkept\n</think>\n\nA"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


def _special(tok: Tokenizer) -> dict[str, str]:
    return {"bos_token": tok.id_to_token(tok.bos_id) or "", "eos_token": tok.id_to_token(tok.eos_id) or ""}


def test_a_template_renders_as_transformers_renders_it(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    special = _special(tok)
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._hf, **special)
    seen = set()
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                for think in (None, False, True):
                    extra = {} if think is None else {"enable_thinking": think}
                    want = oracle.apply_chat_template(messages, tools=tools, chat_template=THINKING_TEMPLATE,
                                                      tokenize=False, add_generation_prompt=gen, **extra)
                    got = render(THINKING_TEMPLATE, messages, add_generation_prompt=gen, enable_thinking=think,
                                 tools=tools, special_tokens=special)
                    assert got == want, (messages, tools, gen, think)
                    seen.add(got)
    # every option reaches the text: 4 conversations x tools or not x (thinking off, on or unset alike, no prompt)
    assert len(seen) == 24
    text = render(THINKING_TEMPLATE, CONVERSATIONS[3], add_generation_prompt=False, enable_thinking=None,
                  tools=TOOLS, special_tokens=special)
    assert "<think>\nkept\n</think>\n\nA" in text and '"Wetter für eine Stadt"' in text


def test_errors_name_the_problem(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match=r"does not parse: line 2: .*endfor"):
        compiled("{% for m in messages %}\n{{ m.content }}")
    refuse = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok"
    kw = {"add_generation_prompt": True, "enable_thinking": None, "tools": None, "special_tokens": _special(tok)}
    assert render(refuse, CONVERSATIONS[0], **kw) == "ok"
    with pytest.raises(ChatTemplateError, match=r"^one message only$"):
        render(refuse, CONVERSATIONS[1], **kw)
    with pytest.raises(ChatTemplateError, match="failed on this conversation: .*unsafe"):  # the sandbox
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", CONVERSATIONS[0], **kw)
    with pytest.raises(ChatTemplateError, match="failed on this conversation: TypeError"):
        render("{{ messages[0].content + 1 }}", CONVERSATIONS[0], **kw)


def test_the_tokenizer_chats_through_a_files_own_template(tok: Tokenizer, tmp_path) -> None:
    """A GGUF carrying another template: load_tokenizer reads it and apply_chat_template renders it; qspec's own
    (QWEN_CHAT_TEMPLATE) and use_chat_template(None) keep the Python format; a broken one is refused when set."""
    kv = tok.to_gguf_metadata(512)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "qwen4exp")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        w.add_string(key, kv[key])
    w.add_token_list(kv["tokenizer.ggml.tokens"])
    w.add_token_types(kv["tokenizer.ggml.token_type"])
    w.add_token_merges(kv["tokenizer.ggml.merges"])
    w.add_chat_template(THINKING_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    own = load_tokenizer(path)
    assert own.chat_template == THINKING_TEMPLATE
    messages = CONVERSATIONS[1]
    want = render(THINKING_TEMPLATE, messages, add_generation_prompt=True, enable_thinking=False, tools=None,
                  special_tokens=_special(own))
    assert own.apply_chat_template(messages, enable_thinking=False) == want
    builtin = tok.apply_chat_template(messages, enable_thinking=False)
    assert builtin != want
    own.use_chat_template(None)
    assert own.chat_template == QWEN_CHAT_TEMPLATE
    assert own.apply_chat_template(messages, enable_thinking=False) == builtin
    with pytest.raises(ChatTemplateError, match="does not parse"):
        own.use_chat_template("{% if %}")
    assert own.chat_template == QWEN_CHAT_TEMPLATE  # unchanged by the refused one
