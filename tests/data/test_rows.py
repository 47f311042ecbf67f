"""TaskRows (issue 47): a prompt as text, chat messages (with the row's tool schemas) or token ids; every field
of a row reaching the rollout function's row; each bad row a DataError naming the file, its line or row and
the column (a ConfigError in a run), and `m2po train` exiting 2 on it before anything starts."""
import json

import pytest

from m2po_megatron.config import load_config
from m2po_megatron.config.schema import DataSection
from m2po_megatron.data.prompts import PromptStream, Tokenize
from m2po_megatron.data.rows import DataError, RowOptions, TaskRow, as_task, load_task_rows, task_state
from m2po_megatron.demo.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

# The tiny tokenizer's two-role template, plus a system turn and the tool schemas (as tool-calling models'
# templates put them in the prompt).
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|user|>tools: {% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters'] | tojson }}) {% endfor %}{% endif %}"
    "{% for m in messages %}{% if m['role'] in ['system', 'user', 'tool'] %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALC = {"type": "function", "function": {"name": "calculator", "description": "evaluates a sum",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    t.chat_template = TOOLS_TEMPLATE
    return t


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def chat(tok, messages, tools=None):
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def test_the_row_options_are_the_recipes_data_options():
    """data/ does not import the config: its RowOptions repeat DataSection's names and defaults."""
    import dataclasses

    section = DataSection()
    assert {f.name: getattr(section, f.name) for f in dataclasses.fields(RowOptions)} == \
        dataclasses.asdict(RowOptions())


def test_text_messages_with_tools_and_ids_prompts(tmp_path, tok):
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    ids = tok("Compute 4+4.", add_special_tokens=False)["input_ids"]
    rows = [{"id": "t", "prompt": "What is 1+1?", "answer": "2"},
            {"id": "m", "prompt": user, "answer": 5, "tools": [CALC]},
            {"id": "i", "prompt": ids, "answer": "8", "tools": [CALC]}]
    t, m, i = load_task_rows(write(tmp_path / "mixed.jsonl", rows), DataSection(tools_key="tools"), tok)
    assert t.prompt == chat(tok, [{"role": "user", "content": "What is 1+1?"}])  # wrapped once, as before
    assert m.prompt == chat(tok, user, [CALC]) and "calculator(" in m.prompt and "Be brief." in m.prompt
    assert m.prompt_ids == tok(m.prompt, add_special_tokens=False)["input_ids"] and m.label == "5"
    assert i.prompt_ids == ids and i.prompt == "Compute 4+4." and "calculator" not in i.prompt  # as given
    # without data.tools_key the schemas stay in the row only; text prompts get them too when it is set
    (m2,) = load_task_rows(write(tmp_path / "m.jsonl", [rows[1]]), DataSection(), tok)
    assert m2.prompt == chat(tok, user) and "calculator" not in m2.prompt and m2.row["tools"] == [CALC]
    (t2,) = load_task_rows(write(tmp_path / "t.jsonl", [{**rows[0], "tools": [CALC]}]),
                           DataSection(tools_key="tools"), tok)
    assert t2.prompt == chat(tok, [{"role": "user", "content": "What is 1+1?"}], [CALC])
    # text as is without the chat template
    (t3,) = load_task_rows(write(tmp_path / "t3.jsonl", [rows[0]]), DataSection(apply_chat_template=False), tok)
    assert t3.prompt == "What is 1+1?" and t3.prompt_ids == tok("What is 1+1?", add_special_tokens=False)["input_ids"]


def test_column_mapping_and_json_text_columns(tmp_path, tok):
    """slime's --input-key/--label-key/--tool-key/--metadata-key names; parquet and CSV keep varying nested
    values as JSON text, which data.prompt_format = messages (and the tools and metadata columns) parse."""
    msgs = [{"role": "user", "content": "What is 6+1?"}]
    row = {"uid": 7, "conversation": json.dumps(msgs), "gold": 7.0, "schemas": json.dumps([CALC]),
           "extra": json.dumps({"difficulty": "easy"})}
    d = DataSection(input_key="conversation", label_key="gold", tools_key="schemas", metadata_key="extra",
                    id_key="uid", prompt_format="messages")
    (t,) = load_task_rows(write(tmp_path / "mapped.jsonl", [row]), d, tok)
    assert (t.id, t.label, t.prompt) == ("7", "7.0", chat(tok, msgs, [CALC]))
    assert t.row == row  # untouched: the JSON text stays text in the row
    # verl's layout: chat messages in `prompt`, the answer nested at reward_model.ground_truth (a dotted key)
    verl = {"data_source": "math", "prompt": msgs, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": 3, "split": "train"}}
    (v,) = load_task_rows(write(tmp_path / "verl.jsonl", [verl]), DataSection(label_key="reward_model.ground_truth",
                                                                              metadata_key="extra_info"), tok)
    assert (v.label, v.prompt, v.row) == ("7", chat(tok, msgs), verl)
    with pytest.raises(DataError, match=r"verl.jsonl:1: column 'reward_model.truth' \(data.label_key\): missing"):
        load_task_rows(str(tmp_path / "verl.jsonl"), DataSection(label_key="reward_model.truth"), tok)
    # auto takes a string for text: the same row is a text prompt of the JSON
    (a,) = load_task_rows(write(tmp_path / "auto.jsonl", [row]), DataSection(input_key="conversation",
                                                                             label_key="gold"), tok)
    assert a.prompt == chat(tok, [{"role": "user", "content": row["conversation"]}])


def test_every_field_reaches_the_row_untouched_through_the_stream_and_the_group(tmp_path, tok):
    from m2po_megatron.rollout.groups import GroupMaker

    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "test_cases": [{"in": [i, 1], "out": i + 1}],
             "meta": {"source": "mine", "nested": {"deep": [None, True, 1.5]}}, "unicode": "√2 ≈ 1.414"}
            for i in range(4)]
    tasks = load_task_rows(write(tmp_path / "train.jsonl", rows), DataSection(metadata_key="meta"), tok)
    assert [t.row for t in tasks] == rows and [t.id for t in tasks] == [f"train/{i}" for i in range(1, 5)]
    stream = PromptStream(tasks, seed=3)
    maker = GroupMaker(None, None, tok, Tokenize(tok, 64), {"temperature": 1.0}, n=2, seed=0)
    for k in range(6):  # more than an epoch
        task = stream.next()
        g = maker.new_group(f"g{k}", task)
        assert g.row == rows[int(task.id.split("/")[1]) - 1] and g.prompt_ids == task.prompt_ids
        assert (g.prompt_id, g.answer) == (task.id, task.label)
    # a resumed stream (positions only) over the rows read again continues the same sequence
    again = PromptStream(load_task_rows(str(tmp_path / "train.jsonl"), DataSection(metadata_key="meta"), tok), 3)
    again.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    assert [again.next().id for _ in range(5)] == [stream.next().id for _ in range(5)]


def test_a_checkpoint_keeps_a_prompt_in_flight_as_its_tokens(tmp_path, tok):
    (task,) = load_task_rows(write(tmp_path / "r.jsonl", [{"prompt": [{"role": "user", "content": "hi"}],
                                                            "answer": "1", "x": [1, {"y": 2}]}]), DataSection(), tok)
    back = as_task(json.loads(json.dumps(task_state(task))))
    assert back == task
    # a checkpoint written before TaskRows kept the row with its final prompt text and answer
    old = as_task({"id": "a/0", "prompt": "What is 1+1?", "answer": "2"}, Tokenize(tok, 64))
    assert (old.id, old.label) == ("a/0", "2")
    assert old.prompt_ids == tok("What is 1+1?", add_special_tokens=False)["input_ids"]
    with pytest.raises(TypeError, match="not a TaskRow"):
        as_task({"prompt": [{"role": "user", "content": "hi"}]}, Tokenize(tok, 64))


def test_labels_are_required_only_when_the_reward_needs_one(tmp_path, tok):
    rows = [{"prompt": "What is 1+1?"}, {"prompt": "What is 2+2?", "answer": ""},
            {"prompt": "What is 3+3?", "answer": [1, 2]}, {"prompt": "What is 4+4?", "answer": 8}]
    path = write(tmp_path / "open.jsonl", rows)
    tasks = load_task_rows(path, DataSection(), tok, require_label=False)
    assert [t.label for t in tasks] == [None, None, None, "8"] and tasks[2].row["answer"] == [1, 2]
    assert [t.label for t in load_task_rows(path, DataSection(label_key=None), tok, require_label=False)] == [None] * 4
    with pytest.raises(DataError, match="data.label_key is null but the reward needs a label"):
        load_task_rows(path, DataSection(label_key=None), tok)
    with pytest.raises(DataError) as e:
        load_task_rows(path, DataSection(), tok)
    msg = str(e.value)  # every bad row is named, in file order
    assert msg.startswith("data.train_path: 3 rows of ") and msg.index("open.jsonl:1: column 'answer'") < \
        msg.index("open.jsonl:2: column 'answer'") < msg.index("open.jsonl:3: column 'answer' (data.label_key): must "
                                                               "be a string or a number")


LONG = "What is " + "1+" * 80 + "1?"
BAD = [  # (row or raw line, DataSection overrides, column, what the message says)
    ({"question": "What is 1+1?", "answer": "2"}, {}, "prompt", "missing; set data.input_key"),
    ({"prompt": 42, "answer": "2"}, {}, "prompt", "must be text, chat messages"),
    ({"prompt": "   ", "answer": "2"}, {}, "prompt", "must be non-empty text"),
    ({"prompt": [], "answer": "2"}, {}, "prompt", "got an empty list"),
    ({"prompt": [], "answer": "2"}, {"prompt_format": "messages"}, "prompt", "chat messages must be a non-empty list"),
    ({"prompt": [{"role": "usr", "content": "hi"}], "answer": "2"}, {}, "prompt", "message 0 has role 'usr'"),
    ({"prompt": [{"from": "human", "value": "hi"}], "answer": "2"}, {}, "prompt", "ShareGPT"),
    ({"prompt": [{"role": "user", "content": 3}], "answer": "2"}, {}, "prompt", "message 0 has content"),
    ({"prompt": [5, 100000], "answer": "2"}, {}, "prompt", "token 1 is 100000: token ids must be integers in [0, "),
    ({"prompt": [5, -1], "answer": "2"}, {"prompt_format": "ids"}, "prompt", "token 1 is -1"),
    ({"prompt": "What is 1+1?", "answer": "2", "meta": [1]}, {"metadata_key": "meta"}, "meta",
     "must be a JSON object, got a list"),
    ({"prompt": "What is 1+1?", "answer": "2", "meta": "{oops"}, {"metadata_key": "meta"}, "meta",
     "string that is not JSON"),
    ({"prompt": "What is 1+1?", "answer": "2", "tools": {"name": "f"}}, {"tools_key": "tools"}, "tools",
     "must be a list of tool schemas (objects), got an object"),
    ({"prompt": "What is 1+1?", "answer": "2", "tools": ["f"]}, {"tools_key": "tools"}, "tools", "holding a string"),
    ({"prompt": "What is 1+1?"}, {}, "answer", "missing or empty; the reward needs a reference answer"),
    ({"prompt": "What is 1+1?", "answer": {"x": 1}}, {}, "answer", "must be a string or a number"),
    ({"prompt": "What is 1+1?", "answer": "2", "id": [1]}, {}, "id", "must be a string or an integer"),
    ({"prompt": LONG, "answer": "2"}, {"max_prompt_len": 64}, "prompt",
     "tokens > data.max_prompt_len = 64; filter the data or raise data.max_prompt_len"),
    ({"prompt": list(range(65)), "answer": "2"}, {"max_prompt_len": 64}, "prompt", "a prompt has 65 tokens"),
    ({"prompt": "What is 1+1?", "answer": "2"}, {"prompt_template": "plain"}, "problem",
     "data.prompt_template is rendered from it"),
    ('["not", "an", "object"]', {}, None, "not an object but a list"),
]


@pytest.mark.parametrize("bad, over, column, needle", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_each_bad_row_names_the_file_the_line_and_the_column(tmp_path, tok, bad, over, column, needle):
    prompt = {"messages": [{"role": "user", "content": "hi"}], "ids": [5, 6]}.get(over.get("prompt_format"), "hi")
    good = {"id": "ok", "prompt": prompt, "answer": "2", "problem": "What is 1+1?"}
    path = write(tmp_path / "rows.jsonl", [good, good, bad])
    with pytest.raises(DataError) as e:
        load_task_rows(path, DataSection(**over), tok, key="data.eval_paths[0]")
    msg = str(e.value)
    where = f"data.eval_paths[0]: {path}:3: " + (f"column {column!r}" if column else "")
    assert msg.startswith(where) and needle in msg, msg


def test_parquet_rows_are_named_by_row_number(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 2+2?", "answer": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"^data.train_path: .*p.parquet: row 2: column 'answer' \(data.label_key\)"):
        load_task_rows(str(tmp_path / "p.parquet"), DataSection(), tok)


def test_messages_need_a_chat_template_and_prepared_prompts_are_not_wrapped_twice(tmp_path):
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    msgs = write(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"m.jsonl:1: column 'prompt' \(data.input_key\): chat messages need a "
                                          r"tokenizer with a chat template"):
        load_task_rows(msgs, DataSection(), plain)
    tok = build_tiny_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    with pytest.raises(DataError, match="chat template fails on these messages"):  # jinja's own error
        tok2 = build_tiny_tokenizer()
        tok2.chat_template = "{{ raise_exception('only user turns') }}"
        load_task_rows(msgs, DataSection(), tok2)
    wrapped = chat(tok, [{"role": "user", "content": "What is 1+1?"}])
    path = write(tmp_path / "prepared.jsonl", [{"prompt": wrapped, "answer": "2", "problem": "What is 1+1?"}])
    with pytest.raises(DataError, match="already carries the chat template.*apply_chat_template=false"):
        load_task_rows(path, DataSection(), tok)
    assert load_task_rows(path, DataSection(apply_chat_template=False), tok)[0].prompt == wrapped
    assert load_task_rows(path, DataSection(prompt_template="plain"), tok)[0].prompt == wrapped  # from `problem`
    with pytest.raises(DataError, match="data.prompt_format = 'chat' is not one of auto, text, messages, ids"):
        load_task_rows(path, DataSection(prompt_format="chat"), tok)
    with pytest.raises(DataError, match="does not apply to data.prompt_format = messages"):
        load_task_rows(path, DataSection(prompt_format="messages", prompt_template="plain"), tok)


def test_many_bad_rows_are_counted_after_the_first_five(tmp_path, tok):
    path = write(tmp_path / "many.jsonl", [{"prompt": "What is 1+1?"}] * 8)
    with pytest.raises(DataError) as e:
        load_task_rows(path, DataSection(), tok)
    msg = str(e.value)
    assert "8 rows of" in msg and "many.jsonl:5:" in msg and "many.jsonl:6:" not in msg and "(and 3 more)" in msg


@pytest.mark.parametrize("row, needle", [
    ({"prompt": [{"role": "user", "content": "hi"}], "answer": "1", "meta": 3}, "column 'meta' (data.metadata_key)"),
    ({"prompt": [999], "answer": "1"}, "column 'prompt' (data.input_key): token 0 is 999"),
], ids=["metadata", "ids"])
def test_m2po_train_exits_2_on_a_bad_row_before_anything_starts(tmp_path, capsys, row, needle):
    """The CLI in this process, with a model directory that has the tokenizer and a config but no weights: the
    data are checked before the weights, Ray or the run directory are needed."""
    import ray
    from transformers import Qwen2Config

    from m2po_megatron.cli import main

    model = tmp_path / "model"
    build_tiny_tokenizer().save_pretrained(model)
    Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(model)
    good = {"prompt": "What is 1+1?", "answer": "2"}
    data = write(tmp_path / "train.jsonl", [good, good, good, row])
    out = tmp_path / "runs"
    argv = ["train", "tiny-cpu", f"model.hf_path={model}", f"data.train_path={data}", "data.eval_paths=[]",
            f"run.output_dir={out}", "data.metadata_key=meta"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"m2po train: data.train_path: {data}:4: {needle}" in err and "Traceback" not in err, err
    assert not out.exists() and not ray.is_initialized()
    # the same recipe with a datasets directory as its data passes the file check and the row check
    import datasets

    datasets.Dataset.from_list([good] * 3).save_to_disk(str(tmp_path / "ds"))
    cfg = load_config("tiny-cpu", [f"model.hf_path={model}", f"data.train_path={tmp_path / 'ds'}",
                                   "data.eval_paths=[]"])
    from m2po_megatron.run.inputs import load_data

    prompts, evals = load_data(cfg, build_tiny_tokenizer())
    assert len(prompts.rows) == 3 and evals == [] and isinstance(prompts.next(), TaskRow)
