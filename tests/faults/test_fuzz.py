"""Fuzzing (hypothesis) of recipe overrides and of data rows: every input either validates or fails with
exit code 2 and a message; no exception escapes, whatever the input."""
import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2po_megatron.cli import main
from m2po_megatron.config import ALL_FIELDS, ConfigError, load_config

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12))
yaml_text = st.one_of(
    scalars.map(json.dumps),
    st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                 max_leaves=6).map(json.dumps),
    st.sampled_from(["[", "{a: ", "!!python/object:os.system", ": :", "- - -", "&a [*a]", "'", "1e999", ".nan",
                     "~", "0x1F", "0o17", "2026-12-01", "null", "[auto]", "{}"]),
    st.text(max_size=20),
)
keys = st.one_of(st.sampled_from(ALL_FIELDS), st.sampled_from(ALL_FIELDS).map(lambda k: k + ".x"),
                 st.text(alphabet="abcz._+", max_size=15))
overrides = st.lists(st.tuples(keys, yaml_text).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=10),
                     max_size=4)


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@SETTINGS
@given(overrides)
def test_any_override_validates_or_fails_with_exit_2_and_a_message(ov):
    rc, out, err = run_cli(["config", "tiny-cpu", "--no-check-files", *ov])
    assert rc in (0, 2), (ov, rc, err)
    if rc == 2:
        assert err.strip() and "Traceback" not in err, (ov, err)
    else:
        assert "memory estimate" in out


_row_value = st.one_of(scalars, st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=4), scalars, max_size=2))
rows = st.lists(st.one_of(
    st.fixed_dictionaries({"prompt": _row_value, "answer": _row_value}),
    st.fixed_dictionaries({"prompt": st.text(max_size=60), "answer": st.text(max_size=8)},
                          optional={"id": _row_value, "source": _row_value}),
    _row_value,
), max_size=5)
lines = st.lists(st.one_of(rows.map(lambda rs: "\n".join(json.dumps(r) for r in rs)), st.text(max_size=40)), max_size=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_task))


@SETTINGS
@given(text=lines)
def test_any_training_file_loads_or_fails_with_a_config_error_naming_it(tiny_task, tokenizer, text):
    from m2po_megatron.run.inputs import load_data

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "train.jsonl"
        path.write_text("\n".join(text))
        cfg = load_config("tiny-cpu", [f"model.hf_path={tiny_task}", f"data.train_path={path}", "data.eval_paths=[]"])
        try:
            prompts, _ = load_data(cfg, tokenizer)
        except ConfigError as e:
            assert "data.train_path" in str(e) and str(path) in str(e), str(e)
        else:
            assert prompts.rows and all(isinstance(r.prompt, str) and r.prompt_ids and r.label for r in prompts.rows)


@SETTINGS
@given(text=lines)
def test_prepare_data_on_any_input_exits_0_or_2(text):
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "raw.jsonl"
        src.write_text("\n".join(text))
        rc, out, err = run_cli(["prepare-data", "--input", str(src), "--out", str(Path(d) / "out"),
                                "--eval-sets", "", "--template", "plain"])
        assert rc in (0, 2), (rc, err)
        if rc == 2:
            assert err.strip() and "Traceback" not in err
        else:
            assert (Path(d) / "out" / "train.jsonl").stat().st_size > 0


_corr_value = st.one_of(st.sampled_from(["bypass", "tis", "mis", "icepop", "geometric", "token", "sequence",
                                         "mask", "truncate", "null", "1", "2.0", "0.5", "0", "-1", ".inf",
                                         ".nan", "true"]), yaml_text)
_corr_overrides = st.lists(st.tuples(st.sampled_from(["mode", "level", "threshold", "threshold_lower",
                                                      "geometric_action"]), _corr_value)
                           .map(lambda kv: f"algo.rollout_correction.{kv[0]}={kv[1]}"), min_size=1, max_size=4)


@SETTINGS
@given(_corr_overrides)
def test_rollout_correction_fields_validate_or_name_the_field(ov):
    """What `m2po config` accepts, the actor accepts (the same CorrectionSpec); what it refuses names
    algo.rollout_correction.<field>."""
    from m2po_megatron.algo.rollout_correction import CorrectionSpec

    rc, out, err = run_cli(["config", "tiny-cpu", "--no-check-files", *ov])
    assert rc in (0, 2), (ov, rc, err)
    if rc == 2:
        assert err.strip() and "Traceback" not in err, (ov, err)
    else:
        cfg = load_config("tiny-cpu", ov, check_files=False)
        CorrectionSpec(**dict(cfg.algo.rollout_correction))
