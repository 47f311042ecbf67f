"""agents.tools on CPU: the parser registry, the m2po_tags format (round trips and broken calls), and chat
rendering: render_suffix's tokens follow the engine's own output ids exactly as the template renders the
whole conversation (a Qwen2.5-style template with tools, on the project's local byte-level tokenizer)."""
import importlib.util

import pytest

from m2po_megatron import api
from m2po_megatron.agents import tools as T

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the notes.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                   "required": ["query", "k"]}}}
TOOLS = [CALC, SEARCH]


# --- registry ---------------------------------------------------------------------------------------------

def test_m2po_tags_is_registered_and_reached_through_the_api():
    assert "m2po_tags" in api.registered_tool_parsers()
    parser = api.tool_parser("m2po_tags")
    assert isinstance(parser, T.TagToolParser) and isinstance(parser, api.ToolParser)


def test_a_registered_name_wins(monkeypatch):
    class Mine:
        def parse(self, text, tools):
            return "mine", []

    monkeypatch.setitem(T.TOOL_PARSERS, "qwen25", Mine)  # even over an SGLang name (the registry restored after)
    assert T.make_tool_parser("qwen25").parse("x", []) == ("mine", [])


def test_unknown_name_names_the_key_and_the_choices():
    with pytest.raises(ValueError) as e:
        T.make_tool_parser("no_such_parser")
    msg = str(e.value)
    assert "rollout.tool_call_parser" in msg and "no_such_parser" in msg and "m2po_tags" in msg
    if importlib.util.find_spec("sglang") is None:
        assert "sglang is not installed" in msg
    else:
        assert "qwen25" in msg


# --- the m2po_tags format ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,args", [("calculator", {"expression": "12*34"}),
                                       ("search", {"query": "cats \"and\" dogs", "k": 3}),
                                       ("search", {"query": "ünïcode", "k": 0})])
def test_json_calls_round_trip(name, args):
    text = "Let me check. " + T.format_call(name, args) + " Done."
    rest, calls = T.TagToolParser().parse(text, TOOLS)
    assert rest == "Let me check.  Done."
    assert [(c.name, c.arguments, c.error) for c in calls] == [(name, args, "")]
    assert calls[0].raw == T.format_call(name, args)


def test_bare_text_goes_to_the_single_required_parameter_and_calls_keep_their_order():
    text = "<call name='calculator'> 12*34 </call>then " + T.format_call("search", {"query": "q", "k": 1})
    rest, calls = T.TagToolParser().parse(text, TOOLS)
    assert rest == "then"
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "12*34"}),
                                                      ("search", {"query": "q", "k": 1})]
    assert T.TagToolParser().parse("no calls here", TOOLS) == ("no calls here", [])


@pytest.mark.parametrize("text,name,why", [
    ('<call name="calculator">12*34', "calculator", "no closing"),
    ('<call name="weather">Paris</call>', "weather", "unknown tool"),
    ('<call name="search">{"query": "q", </call>', "search", "not valid JSON"),
    ('<call name="search">cats</call>', "search", "one required parameter"),
    ('<call>12*34</call>', "", "no name"),
    ('<call name="">12*34</call>', "", "no name"),
])
def test_broken_calls_come_back_with_an_error(text, name, why):
    rest, calls = T.TagToolParser().parse("before " + text, TOOLS)
    assert rest == "before" and len(calls) == 1
    assert calls[0].name == name and calls[0].arguments == {} and why in calls[0].error
    assert calls[0].raw == text


def test_a_broken_call_does_not_hide_the_good_ones():
    text = '<call name="x">1</call><call name="calculator">{"expression": "1+1"}</call><call name="calculator">2'
    _, calls = T.TagToolParser().parse(text, TOOLS)
    assert [bool(c.error) for c in calls] == [True, False, True]
    assert calls[1].arguments == {"expression": "1+1"}


# --- rendering ----------------------------------------------------------------------------------------------

# Modelled on Qwen2.5-Instruct's template: tools in the system prompt, assistant tool calls as <tool_call>
# JSON, consecutive tool results in one user turn of <tool_response> blocks.
QWEN25_STYLE = """
{%- if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% else %}{% set sys = 'You are a helpful assistant.' %}{% endif %}
{{- '<|im_start|>system\n' + sys }}
{%- if tools %}
    {{- '\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags.' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) or (m.role == 'assistant' and not m.tool_calls) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}{{- '\n' + m.content }}{%- endif %}
        {%- for c in m.tool_calls %}
            {%- if c.function is defined %}{% set c = c.function %}{% endif %}
            {{- '\n<tool_call>\n{"name": "' + c.name + '", "arguments": ' + (c.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def qwen_tok():
    from tokenizers import AddedToken

    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")],
                   special_tokens=True)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])  # as Qwen: not special
    tok.chat_template = QWEN25_STYLE
    return tok


def _generated(tok, text):
    """What the engine returns for an assistant turn: its text's ids and the end-of-turn token."""
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


def test_render_ids_puts_the_tools_in_the_prompt(qwen_tok):
    msgs = [{"role": "user", "content": "What is 12*34?"}]
    ids = api.render_messages(qwen_tok, msgs, TOOLS)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = qwen_tok.decode(ids)
    assert '"name": "calculator"' in text and "Evaluate an arithmetic expression." in text
    assert text.endswith("<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in qwen_tok.decode(T.render_ids(qwen_tok, msgs))
    bare = T.render_ids(qwen_tok, msgs, TOOLS, add_generation_prompt=False)
    assert ids[:len(bare)] == bare and qwen_tok.decode(ids[len(bare):]) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_suffixes_after_generated_ids_rebuild_the_template_render(qwen_tok, tools):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    convo = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is 12*34 and 5+5?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}},
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "5+5"}}}]},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "tool", "name": "calculator", "content": "10"},
        {"role": "assistant", "content": "408 and 10."},
        {"role": "user", "content": "Thanks!"},
    ]
    generated = [call + "\n" + call.replace("12*34", "5+5"), "408 and 10."]
    ids = T.render_ids(qwen_tok, convo[:2], tools)
    ids += _generated(qwen_tok, generated[0])
    ids += T.render_suffix(qwen_tok, convo[3:5], tools)
    ids += _generated(qwen_tok, generated[1])
    ids += T.render_suffix(qwen_tok, convo[6:], tools)
    assert ids == T.render_ids(qwen_tok, convo, tools)
    assert api.render_suffix(qwen_tok, convo[3:5], tools) == T.render_suffix(qwen_tok, convo[3:5], tools)
    # the suffix starts with the "\n" the template writes after <|im_end|>, which the model did not generate
    suffix = T.render_suffix(qwen_tok, convo[6:], tools, add_generation_prompt=False)
    assert qwen_tok.decode(suffix) == "\n<|im_start|>user\nThanks!<|im_end|>\n"


def test_suffix_with_an_end_token_last_and_the_context_option():
    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # "<|assistant|>...</s>": nothing after the end token
    convo = [{"role": "user", "content": "Compute 2+2"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "and 3+3"}]
    gen = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
    ids = T.render_ids(tok, convo[:1]) + gen + T.render_suffix(tok, convo[2:])
    assert ids == T.render_ids(tok, convo)
    assert T.render_suffix(tok, convo[2:], context=convo[:2]) == T.render_suffix(tok, convo[2:])
    with pytest.raises(ValueError, match="assistant"):
        T.render_suffix(tok, convo[2:], context=convo[:1])


def test_a_template_that_rewrites_earlier_turns_is_refused(qwen_tok):
    rewriting = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n"
                 "{%- if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}{% endif %}"
                 "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    saved = qwen_tok.chat_template
    qwen_tok.chat_template = rewriting
    try:
        with pytest.raises(ValueError, match="rollout.tool_call_parser.*extension"):
            T.render_suffix(qwen_tok, [{"role": "user", "content": "more"}])
    finally:
        qwen_tok.chat_template = saved
