"""render_chat against transformers' apply_chat_template, sandboxing, built-in formats, reasoning split.

The templates below are written for these tests in the formats the models publish:
DeepSeek-V3.1/V4 (``<｜User｜>``/``<｜Assistant｜>``/``<think>``, the layout of
DeepSeek-V4's ``encoding_dsv4.py``), Kimi-K2-Instruct (``<|im_*|>`` markers) and
Kimi-K3 (XTML ``<|open|>message ...<|sep|>`` blocks). They use the Jinja features real
chat templates rely on (namespace, macros, loop controls, tojson options,
raise_exception, whitespace control, trim/lstrip blocks).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from engine.text import (
    ChatTemplateError,
    ReasoningSplitter,
    builtin_format_for_vocab,
    reasoning_splitter_for,
    render_chat,
    split_reasoning,
)

DS_BOS = "<｜begin▁of▁sentence｜>"
DS_EOS = "<｜end▁of▁sentence｜>"

DEEPSEEK_TEMPLATE = """{#- DeepSeek-V3.1 / V4 layout -#}
{%- if thinking is not defined -%}
  {%- set thinking = enable_thinking if enable_thinking is defined else false -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}
    {{- m['content'] -}}
  {%- elif m['role'] == 'user' -%}
    {{- '<｜User｜>' + m['content'] -}}
    {%- set nxt = none if loop.last else messages[loop.index0 + 1]['role'] -%}
    {%- if nxt == 'assistant' or (loop.last and add_generation_prompt) -%}
      {{- '<｜Assistant｜>' + ('<think>' if thinking and loop.index0 >= ns.last_user else '</think>') -}}
    {%- endif -%}
  {%- elif m['role'] == 'assistant' -%}
    {%- if thinking and loop.index0 > ns.last_user -%}
      {{- m.get('reasoning_content', '') + '</think>' -}}
    {%- endif -%}
    {{- m['content'] + eos_token -}}
  {%- else -%}
    {{- raise_exception('Unsupported role: ' + m['role']) -}}
  {%- endif -%}
{%- endfor -%}
"""

KIMI_K2_TEMPLATE = """{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    <|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>
  {%- endif -%}
  {%- if message['role'] in ['system', 'tool'] -%}<|im_system|>
  {%- elif message['role'] == 'user' -%}<|im_user|>
  {%- else -%}<|im_assistant|>
  {%- endif -%}
  {{- message['role'] }}<|im_middle|>
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- else -%}
    {%- for part in message['content'] -%}{{- part['text'] -}}{%- endfor -%}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

KIMI_K3_TEMPLATE = """{%- macro open_tag(tag, attrs=[]) -%}
{{- '<|open|>' + tag -}}
{%- for attr in attrs -%}{{- ' ' + attr[0] + '="' + (attr[1]|string|replace('&', '&amp;')|replace('"', '&quot;')) + '"' -}}{%- endfor -%}
{{- '<|sep|>' -}}
{%- endmacro -%}
{%- macro close_tag(tag) -%}{{- '<|close|>' + tag + '<|sep|>' -}}{%- endmacro -%}
{%- if thinking is undefined -%}{%- set thinking = true -%}{%- endif -%}
{%- if thinking_effort is undefined -%}{%- set thinking_effort = 'max' -%}{%- endif -%}
{%- if thinking and thinking_effort in ['low', 'medium', 'high', 'max'] -%}
  {{- open_tag('message', [('role', 'system'), ('type', 'thinking-effort')]) -}}
  {{- ('`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\\nNow the system is invoked with `thinking_effort=' + thinking_effort + '`.')|trim -}}
  {{- close_tag('message') + '<|end_of_msg|>' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- set attrs = [('role', message.role)] -%}
  {%- if message.get('name') -%}{%- set attrs = attrs + [('name', message.name)] -%}{%- endif -%}
  {{- open_tag('message', attrs) -}}
  {%- if message.role == 'assistant' -%}
    {%- if thinking -%}
      {{- open_tag('think') -}}
      {%- set r = message.get('reasoning_content') -%}
      {%- if r is not none and r|trim -%}{{- r -}}{%- endif -%}
      {{- close_tag('think') -}}
    {%- endif -%}
    {{- open_tag('response') + message.content + close_tag('response') -}}
  {%- else -%}
    {{- message.content -}}
  {%- endif -%}
  {{- close_tag('message') + '<|end_of_msg|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- open_tag('message', [('role', 'assistant')]) + open_tag('think' if thinking else 'response') -}}
{%- endif -%}
"""  # noqa: E501 (the template's own long lines, kept verbatim)

SINGLE = [{"role": "user", "content": "Hello, 你好!"}]
WITH_SYSTEM = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]
MULTI_TURN = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greeting"},
    {"role": "user", "content": "Tell me a joke 😀"},
    {"role": "assistant", "content": "Why did...", "reasoning_content": "pick a pun"},
    {"role": "user", "content": "Another"},
]
ENDS_WITH_ASSISTANT = MULTI_TURN[:5]
CONVERSATIONS = [SINGLE, WITH_SYSTEM, MULTI_TURN, ENDS_WITH_ASSISTANT]


@pytest.fixture(scope="module")
def hf_tokenizer():
    core = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=DS_BOS, eos_token=DS_EOS)


def hf_render(tok, template, messages, **kwargs):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


# --------------------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("template", [DEEPSEEK_TEMPLATE, KIMI_K2_TEMPLATE, KIMI_K3_TEMPLATE],
                         ids=["deepseek", "kimi-k2", "kimi-k3"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["single", "system", "multi", "ends-assistant"])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_matches_transformers(hf_tokenizer, template, messages, gen, thinking):
    think_kw = {} if thinking is None else {"enable_thinking": thinking, "thinking": thinking}
    expected = hf_render(hf_tokenizer, template, messages, add_generation_prompt=gen, **think_kw)
    got = render_chat(
        template, messages, add_generation_prompt=gen, bos_token=DS_BOS, eos_token=DS_EOS, enable_thinking=thinking
    )
    assert got == expected


def test_tools_and_filters_match_transformers(hf_tokenizer):
    template = (
        "{% for t in tools %}{{ t | tojson }}|{{ t | tojson(indent=2, sort_keys=true) }}|"
        "{{ t | tojson(ensure_ascii=true, separators=(',', ':')) }}\n{% endfor %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "  {% generation %}{{ m.role }}={{ m.content }}{% endgeneration %}\n"
        "{% endfor %}{{ dict(a=1) | tojson }} {{ strftime_now('%Y') | length }} {{ documents }}"
    )
    tools = [{"type": "function", "function": {"name": "weather", "description": "Wetter in München ☀",
                                               "parameters": {"b": 1, "a": [1, 2]}}}]
    expected = hf_render(hf_tokenizer, template, MULTI_TURN, tools=tools, add_generation_prompt=True)
    assert render_chat(template, MULTI_TURN, tools=tools, bos_token=DS_BOS, eos_token=DS_EOS) == expected
    assert "München" in expected and "\\u00fcnchen" not in expected.split("|")[0]


def test_none_fields_dropped_and_extra_variables(hf_tokenizer):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:{{ m.thinking }};{% endfor %}"
                "{{ custom }}")
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "x", "reasoning": "why"}]
    expected = hf_render(hf_tokenizer, template, messages, custom="C")
    assert render_chat(template, messages, custom="C") == expected == "user:False:;assistant:True:why;C"


# --------------------------------------------------------------------------- sandbox


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__['os'] }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
        "{{ namespace(_evil=1) }}",
        "{{ ''['__class__'] }}",
        "{% for m in messages %}{{ messages.append(m) }}{% endfor %}",
    ],
)
def test_hostile_templates_refused(template):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(template, SINGLE)
    assert "stopped" in str(info.value) or "unsafe" in str(info.value)


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="refused the conversation: no system allowed"):
        render_chat("{{ raise_exception('no system allowed') }}", SINGLE)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat("ok\n{% for %}", SINGLE)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat(DEEPSEEK_TEMPLATE, [])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, SINGLE)
    with pytest.raises(ChatTemplateError, match="Unsupported role"):
        render_chat(DEEPSEEK_TEMPLATE, [{"role": "wizard", "content": "x"}])


def test_template_errors_name_the_template():
    source = "tokenizer.chat_template of Some-Model-7B"
    for template in ("{{ raise_exception('no') }}", "ok\n{% for %}", "{{ ''.__class__ }}", "{{ 1 // 0 }}",
                     "{{ messages.x.y }}", "{% for i in range(10**6) %}{% endfor %}"):
        with pytest.raises(ChatTemplateError) as info:
            render_chat(template, SINGLE, template_source=source)
        assert source in str(info.value), (template, str(info.value))
    with pytest.raises(ChatTemplateError, match=r"the chat template \(tokenizer\.chat_template\)"):
        render_chat("{{ 1 // 0 }}", SINGLE)


# --------------------------------------------------------------------------- built-in formats


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["single", "system", "multi", "ends-assistant"])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_builtin_formats_match_templates(messages, gen, thinking):
    kw = {"add_generation_prompt": gen, "enable_thinking": thinking}
    ds = render_chat(None, messages, fallback="deepseek-v4", **kw)
    assert ds == render_chat(DEEPSEEK_TEMPLATE, messages, bos_token=DS_BOS, eos_token=DS_EOS, **kw)
    k3 = render_chat(None, messages, fallback="kimi-k3", **kw)
    assert k3 == render_chat(KIMI_K3_TEMPLATE, messages, **kw)
    if not thinking:
        assert render_chat(None, messages, fallback="kimi-k2", **kw) == render_chat(KIMI_K2_TEMPLATE, messages, **kw)


def test_deepseek_v4_layout_literal():
    # encoding_dsv4.encode_messages(messages, thinking_mode="thinking") for this chat
    assert render_chat(None, MULTI_TURN, fallback="deepseek-v4", enable_thinking=True) == (
        DS_BOS + "Be kind.<｜User｜>Hi<｜Assistant｜></think>Hello!" + DS_EOS
        + "<｜User｜>Tell me a joke 😀<｜Assistant｜></think>Why did..." + DS_EOS
        + "<｜User｜>Another<｜Assistant｜><think>"
    )
    assert render_chat(None, SINGLE, fallback="deepseek-v4").endswith("<｜Assistant｜></think>")
    tool_turn = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking"},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
    ]
    assert render_chat(None, tool_turn, fallback="deepseek-v4") == (
        DS_BOS + "<｜User｜>weather?<｜Assistant｜></think>checking" + DS_EOS
        + "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>22C</tool_result><｜Assistant｜></think>"
    )


def test_kimi_k3_layout_literal():
    out = render_chat(None, WITH_SYSTEM, fallback="kimi-k3", enable_thinking=False)
    assert out == (
        '<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    thinking = render_chat(None, SINGLE, fallback="kimi-k3", thinking_effort="low")
    assert thinking.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    assert "`thinking_effort=low`" in thinking and thinking.endswith("<|open|>think<|sep|>")


def test_builtin_refusals():
    with pytest.raises(ChatTemplateError, match="tool declarations"):
        render_chat(None, SINGLE, fallback="kimi-k3", tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(ChatTemplateError, match="no reasoning channel"):
        render_chat(None, SINGLE, fallback="kimi-k2", enable_thinking=True)
    with pytest.raises(ChatTemplateError, match="unknown built-in"):
        render_chat(None, SINGLE, fallback="llama")
    with pytest.raises(ChatTemplateError, match="thinking_effort"):
        render_chat(None, SINGLE, fallback="kimi-k3", thinking_effort="extreme")
    with pytest.raises(ChatTemplateError, match="image"):
        render_chat(None, [{"role": "user", "content": [{"type": "image", "url": "x"}]}], fallback="kimi-k3")


def test_builtin_format_for_vocab():
    assert builtin_format_for_vocab({"<｜User｜>", "<｜Assistant｜>", DS_EOS, "a"}) == "deepseek-v4"
    k3 = {"<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>",
          "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"}
    assert builtin_format_for_vocab(k3) == "kimi-k3"
    assert builtin_format_for_vocab(k3 - {"<|open|>"}) == "kimi-k2"
    assert builtin_format_for_vocab({"<s>", "</s>"}) is None


# --------------------------------------------------------------------------- reasoning split

OUTPUTS = [
    ("<think>let me think</think>The answer is 4.", True, "let me think", "The answer is 4."),
    ("  <think>a<b</think>c", True, "a<b", "c"),
    ("No reasoning here, just <think> mentioned.", False, "", "No reasoning here, just <think> mentioned."),
    ("<thin", False, "", "<thin"),
    ("<think>never closed", True, "never closed", ""),
    ("</thinkish> plain", False, "", "</thinkish> plain"),
]


@pytest.mark.parametrize("text,_,reasoning,answer", OUTPUTS)
def test_split_reasoning_whole_and_char_by_char(text, _, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)
    splitter = ReasoningSplitter()
    r, a = "", ""
    for ch in text:  # every tag is split across deltas
        d = splitter.feed(ch)
        r, a = r + d.reasoning, a + d.answer
    d = splitter.flush()
    assert (r + d.reasoning, a + d.answer) == (reasoning, answer)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.text(alphabet="ab <>/thinkx", max_size=20),
    st.text(alphabet="ab <>/thinkx", max_size=20),
    st.lists(st.integers(1, 6), min_size=1, max_size=20),
)
def test_splitter_any_chunking(reasoning, answer, cuts):
    # prompt opened the block (DeepSeek thinking mode): output is reasoning</think>answer
    reasoning = reasoning.replace("</think>", "")
    text = reasoning + "</think>" + answer
    splitter = ReasoningSplitter(start_in_reasoning=True)
    r, a, pos, i = "", "", 0, 0
    while pos < len(text):
        step = cuts[i % len(cuts)]
        d = splitter.feed(text[pos : pos + step])
        r, a, pos, i = r + d.reasoning, a + d.answer, pos + step, i + 1
    d = splitter.flush()
    assert (r + d.reasoning, a + d.answer) == (reasoning, answer)


def test_kimi_k3_splitter_strips_block_markup():
    out = "plan it<|close|>think<|sep|><|open|>response<|sep|>Done.<|close|>response<|sep|><|close|>message<|sep|>"
    splitter = reasoning_splitter_for("kimi-k3", thinking=True)
    r, a = "", ""
    for i in range(0, len(out), 3):
        d = splitter.feed(out[i : i + 3])
        r, a = r + d.reasoning, a + d.answer
    d = splitter.flush()
    assert (r + d.reasoning, a + d.answer) == ("plan it", "Done.")
    ds = reasoning_splitter_for("deepseek-v4", thinking=True)
    assert ds.in_reasoning and ds.feed("x</think>y").answer == "y"
