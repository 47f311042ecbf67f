"""`rollout.tool_call_parser: <SGLang name>` parses what the real SGLang parses: make_tool_parser wraps
sglang's FunctionCallParser of that --tool-call-parser name, turns our OpenAI-style tool schemas into its
Tool objects, and gives ToolCalls with the arguments as a dict. Model-style text per format."""
import pytest

from m2po_megatron.agents.tools import SGLangToolParser, make_tool_parser

pytestmark = pytest.mark.timeout(120)


def _tool(name, params, required):
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool.", "parameters": {
        "type": "object", "properties": params, "required": required}}}


TOOLS = [_tool("calculator", {"expression": {"type": "string"}}, ["expression"]),
         _tool("search", {"query": {"type": "string"}, "k": {"type": "integer"}}, ["query", "k"])]
CALC = ("calculator", {"expression": "12*34"})
SEARCH = ("search", {"query": "cats", "k": 2})

CASES = {
    "qwen25": ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "cats", "k": 2}}\n</tool_call>',
               "Let me compute.", [CALC, SEARCH]),
    "hermes": ('Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
               "Let me compute.", [CALC]),
    "llama3": ('<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*34"}}', "", [CALC]),
    "mistral": ('Let me compute. [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "12*34"}}, '
                '{"name": "search", "arguments": {"query": "cats", "k": 2}}]', "Let me compute.", [CALC, SEARCH]),
    "pythonic": ('[calculator(expression="12*34"), search(query="cats", k=2)]', "", [CALC, SEARCH]),
    "qwen3_coder": ("Let me compute.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n12*34\n"
                    "</parameter>\n</function>\n</tool_call>", "Let me compute.", [CALC]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sglang_parsers_find_the_calls(name):
    text, normal, expected = CASES[name]
    parser = make_tool_parser(name)
    assert isinstance(parser, SGLangToolParser)
    rest, calls = parser.parse(text, TOOLS)
    assert rest.strip() == normal
    assert [(c.name, c.arguments, c.error) for c in calls] == [(n, a, "") for n, a in expected]


def test_text_without_calls_and_unparsable_calls():
    parser = make_tool_parser("qwen25")
    assert parser.parse("The answer is 408.", TOOLS) == ("The answer is 408.", [])
    for broken in ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                   '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'):
        _, calls = parser.parse(broken, TOOLS)
        assert len(calls) == 1 and calls[0].error and calls[0].arguments == {}  # counted as a failed call


def test_unknown_names_list_sglangs_parsers():
    with pytest.raises(ValueError, match=r"rollout\.tool_call_parser.*'no_such'.*m2po_tags.*qwen25"):
        make_tool_parser("no_such")
    assert make_tool_parser("m2po_tags").parse('<call name="calculator">1+1</call>', TOOLS)[1][0].arguments == {
        "expression": "1+1"}
