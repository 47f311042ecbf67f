"""Recipes: inheritance, overrides, and every validation rule (each error names the field and the fix)."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from m2po_megatron.config import ConfigError, load_config, redact, save_resolved


def write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def err(tmp_path, overrides=None, recipe=None, **kw):
    with pytest.raises(ConfigError) as e:
        load_config(recipe, overrides or [], **kw)
    return str(e.value)


def test_defaults_are_the_papers():
    cfg = load_config()
    assert cfg.algo.name == "m2po" and cfg.algo.m2po.tau == 0.04 and cfg.algo.m2po.rule == "remove"
    assert cfg.optim.lr == 1e-6 and cfg.optim.clip_grad == 1.0 and cfg.train.updates_per_step == 4


def test_inheritance_chain_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", {"algo": {"name": "grpo", "m2po": {"tau": 0.1}}, "train": {"steps": 7}})
    write(tmp_path / "mid.yaml", {"extends": "base.yaml", "train": {"steps": 9}})
    child = write(tmp_path / "child.yaml", {"extends": "mid", "algo": {"name": "m2po"}})
    cfg = load_config(child, ["algo.m2po.tau=0.02", "rollout.urls=[http://a:1,http://b:2]"])
    assert cfg.algo.name == "m2po"          # child wins over base
    assert cfg.train.steps == 9             # mid wins over base
    assert cfg.algo.m2po.tau == 0.02        # override wins over everything
    assert list(cfg.rollout.urls) == ["http://a:1", "http://b:2"]


def test_inheritance_loop(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    assert "loop" in err(tmp_path, recipe=tmp_path / "a.yaml")


def test_unknown_key_suggests_closest(tmp_path):
    r = write(tmp_path / "r.yaml", {"algo": {"m2po": {"tua": 0.1}}})
    msg = err(tmp_path, recipe=r)
    assert "algo.m2po.tua" in msg and "algo.m2po.tau" in msg and "r.yaml" in msg
    assert "'parallel.tensor_model_parallel_size'" in err(tmp_path, ["parallel.tensor_parallel_size=2"])
    assert "unknown key 'nosection'" in err(tmp_path, ["nosection.x=1"])


def test_wrong_type_names_field():
    msg = err(None, ["train.steps=many"])
    assert "train.steps" in msg and "int" in msg


@pytest.mark.parametrize("override, needle", [
    ("staleness.max_staleness=-1", "staleness.max_staleness"),
    ("staleness.lag_steps=-2", "staleness.lag_steps"),
    ("algo.m2po.tau=-0.1", "algo.m2po.tau"),
    ("train.steps=0", "train.steps"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("optim.adam_beta2=1.0", "optim.adam_beta2"),
    ("algo.dual_clip_c=0.5", "algo.dual_clip_c"),
    ("algo.name=ppo", "algo.name"),
    ("algo.m2po.rule=clip", "algo.m2po.rule"),
    ("staleness.mode=async", "staleness.mode"),
    ("rollout.mem_fraction_static=1.2", "rollout.mem_fraction_static"),
    ("run.resume=/no/such/ckpt", "run.resume"),
    ("parallel.recompute_granularity=layer", "parallel.recompute_granularity"),
    ("parallel.recompute_method=blocks", "did you mean 'block'"),
    ("parallel.recompute_num_layers=0", "parallel.recompute_num_layers"),
    ("eval.steps=[4,0]", "eval.steps"),
    ("train.filter_groups.max_num_gen_batches=-1", "train.filter_groups.max_num_gen_batches"),
    ("train.filter_groups.metric=score", "train.filter_groups.metric"),
])
def test_range_and_choice_rules(override, needle):
    assert needle in err(None, [override])


def test_cross_field_rules():
    assert "sequence_parallel" in err(None, ["parallel.sequence_parallel=true"])
    msg = err(None, ["train.prompts_per_step=10", "train.updates_per_step=4"])
    assert "train.prompts_per_step" in msg and "train.updates_per_step" in msg
    msg = err(None, ["cluster.gpus_per_node=8", "cluster.trainer_nodes=2", "parallel.tensor_model_parallel_size=4"])
    assert "trainer GPUs" in msg and "16" in msg and "parallel.data_parallel_size = 4" in msg
    assert "lag_steps" in err(None, ["staleness.mode=on_policy", "staleness.lag_steps=2"])
    assert "sync_interval" in err(None, ["staleness.max_staleness=2", "staleness.sync_interval=3"])
    assert "virtual_pipeline" in err(None, ["parallel.virtual_pipeline_model_parallel_size=2"])
    assert "rollout.engine = sglang" in err(None, ["rollout.engine=sglang"])
    msg = err(None, ["train.prompts_per_step=4", "train.updates_per_step=4", "rollout.n_samples_per_prompt=3",
                     "parallel.data_parallel_size=2"])
    assert "parallel.data_parallel_size" in msg


def test_layouts_the_actor_cannot_run_are_refused_at_config_time():
    assert "parallel.context_parallel_size = 2" in err(None, ["parallel.context_parallel_size=2",
                                                              "parallel.data_parallel_size=1"])
    msg = err(None, ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"])
    assert "parallel.virtual_pipeline_model_parallel_size = 2" in msg and "null" in msg
    assert "model.params_dtype = fp16" in err(None, ["model.params_dtype=fp16"])
    sp = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
    # megatron's local layers run sequence parallel too (models/norm.LocalNorm)
    assert load_config(None, sp + ["model.attention_backend=sdpa"]).parallel.sequence_parallel
    assert "model.attention_backend = te" in err(None, ["model.fp8=e4m3", "model.attention_backend=local"])
    assert "model.attention_backend" in err(None, ["model.attention_backend=flash"])
    msg = err(None, ["cluster.gpus_per_node=6", "cluster.trainer_nodes=2", "parallel.tensor_model_parallel_size=4",
                     "parallel.data_parallel_size=3"])
    assert "cluster.gpus_per_node = 6" in msg and "one node" in msg and "trainer GPUs" not in msg
    # rollout GPUs: tp x dp per server (dp_size > 1 is refused for SGLang's distributed weight sync)
    rollout = ["cluster.gpus_per_node=8", "cluster.rollout_nodes=1", "parallel.data_parallel_size=8",
               "rollout.engine=sglang", "rollout.tp_size=4"]
    assert load_config(None, rollout + ["rollout.num_servers=2"]).rollout.num_servers == 2
    msg = err(None, rollout + ["rollout.num_servers=3"])
    assert "4 x 1 GPUs exceed the 8 rollout GPUs" in msg and "rollout.num_servers = 2" in msg
    assert "rollout.tp_size x rollout.dp_size = 3" in err(None, rollout[:-1] + ["rollout.tp_size=3"])
    assert "rollout.dp_size = 2" in err(None, rollout + ["rollout.dp_size=2"])


def test_a_node_split_between_trainer_and_servers():
    """cluster.trainer_gpus_per_node: the trainer takes that many GPUs of each trainer node, the servers (with
    rollout_nodes = 0) the rest; each count is checked against the layout."""
    split = ["cluster.gpus_per_node=8", "cluster.rollout_nodes=0", "cluster.trainer_gpus_per_node=4",
             "parallel.data_parallel_size=4", "rollout.engine=sglang", "rollout.tp_size=2", "rollout.num_servers=2"]
    cfg = load_config(None, split)
    assert cfg.cluster.trainer_gpus_per_node == 4 and cfg.rollout.num_servers == 2
    msg = err(None, split[:3] + ["parallel.data_parallel_size=8"] + split[4:])
    assert "cluster.trainer_nodes x cluster.trainer_gpus_per_node = 1 x 4 = 4" in msg
    assert "parallel.data_parallel_size = 4" in msg
    msg = err(None, split[:-1] + ["rollout.num_servers=3"])  # 3 x 2 GPUs, 4 left on the node
    assert "exceed the 4 rollout GPUs" in msg and "rollout.num_servers = 2" in msg
    assert "rollout GPUs per node = 4 are not a multiple of rollout.tp_size x rollout.dp_size = 8" in err(
        None, split[:-2] + ["rollout.tp_size=8", "rollout.num_servers=1"])
    msg = err(None, ["cluster.gpus_per_node=8", "cluster.trainer_gpus_per_node=12", "parallel.data_parallel_size=8"])
    assert "cluster.trainer_gpus_per_node = 12" in msg and "at most" in msg
    msg = err(None, ["cluster.gpus_per_node=8", "cluster.rollout_nodes=1", "cluster.trainer_gpus_per_node=4",
                     "parallel.data_parallel_size=4"])
    assert "needs cluster.rollout_nodes = 0" in msg
    msg = err(None, split[:3] + ["parallel.tensor_model_parallel_size=8", "parallel.data_parallel_size=1",
                                 "cluster.trainer_gpus_per_node=4"])
    assert "cluster.trainer_gpus_per_node = 4 is not a multiple of parallel.tensor_model_parallel_size = 8" in msg


def test_model_layout_rules(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 28, "num_key_value_heads": 4,
         "num_hidden_layers": 28, "max_position_embeddings": 4096}))
    msg = err(tmp_path, [f"model.hf_config={tmp_path / 'm'}", "parallel.tensor_model_parallel_size=8"])
    assert "num_attention_heads = 28" in msg and "tensor_model_parallel_size = 8" in msg
    msg = err(tmp_path, [f"model.hf_config={tmp_path / 'm'}", "parallel.pipeline_model_parallel_size=3"])
    assert "num_hidden_layers = 28" in msg
    msg = err(tmp_path, [f"model.hf_config={tmp_path / 'm'}", "rollout.max_new_tokens=4000"])
    assert "max_position_embeddings" in msg
    ok = load_config(None, [f"model.hf_config={tmp_path / 'm'}", "parallel.tensor_model_parallel_size=4",
                            "parallel.pipeline_model_parallel_size=4", "rollout.max_new_tokens=2048"])
    assert ok.parallel.tensor_model_parallel_size == 4
    assert "model.hf_path" in err(tmp_path, ["model.hf_path=/no/such/model"])
    full = [f"model.hf_config={tmp_path / 'm'}", "parallel.pipeline_model_parallel_size=2",
            "parallel.recompute_granularity=full"]
    assert "14 layers of a pipeline stage" in err(tmp_path, full + ["parallel.recompute_num_layers=4"])
    assert "use at most 14" in err(tmp_path, full + ["parallel.recompute_method=block",
                                                     "parallel.recompute_num_layers=15"])
    assert load_config(None, full + ["parallel.recompute_num_layers=7"]).parallel.recompute_num_layers == 7


def test_rollout_rules_of_sglang(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 28, "num_key_value_heads": 4,
         "num_hidden_layers": 28, "max_position_embeddings": 4096}))
    hf = f"model.hf_config={tmp_path / 'm'}"
    msg = err(tmp_path, [hf, "data.max_prompt_len=1536", "rollout.max_new_tokens=2560"])  # the old recipes
    assert "last 2 positions" in msg and "data.max_prompt_len to 1534" in msg
    assert load_config(None, [hf, "data.max_prompt_len=1534", "rollout.max_new_tokens=2560"])
    msg = err(tmp_path, [hf, "rollout.context_length=3000", "rollout.max_new_tokens=2048"])
    assert "exceeds rollout.context_length = 3000" in msg
    assert "use at most 4096" in err(tmp_path, [hf, "rollout.context_length=8192"])
    assert "eval.max_new_tokens" in err(tmp_path, [hf, "rollout.max_new_tokens=1024", "eval.max_new_tokens=4000"])
    assert "rollout.num_servers" in err(tmp_path, ["rollout.dp_size=2"])
    assert "rollout.pause_mode = in_place" in err(tmp_path, ["rollout.update_mode=in_flight"])
    assert "sglang-router is not used" in err(tmp_path, ["rollout.router=sglang-router"])
    assert "did you mean 'in_place'" in err(tmp_path, ["rollout.pause_mode=inplace"])


def test_all_errors_reported_together():
    msg = err(None, ["train.steps=0", "algo.name=x"])
    assert "train.steps" in msg and "algo.name" in msg


def test_resolved_config_written_without_secrets(tmp_path):
    cfg = load_config(None, ["rollout.api_key=sk-very-secret"])
    out = save_resolved(cfg, tmp_path / "run")
    text = out.read_text()
    assert "sk-very-secret" not in text and "api_key: '***'" in text
    again = yaml.safe_load(text)
    assert again["algo"]["m2po"]["tau"] == 0.04
    assert redact({"nested": {"wandb_api_key": "x", "keep": 1}}) == {"nested": {"wandb_api_key": "***", "keep": 1}}


def test_cli_config_command(tmp_path):
    r = write(tmp_path / "r.yaml", {"algo": {"m2po": {"tua": 0.1}}})
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "config", str(r)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "algo.m2po.tau" in p.stderr
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "config", str(r), "algo.m2po={tau: 0.1}",
                        "--no-check-files"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2  # the recipe's typo still fails even if an override sets the right key
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "config" in p.stdout


def test_missing_hf_config_and_repo_relative_paths(tmp_path, monkeypatch):
    assert "model.hf_config" in err(tmp_path, ["model.hf_config=/no/such/dir"])
    monkeypatch.chdir(tmp_path)  # a recipe's bundled config is the project's from anywhere (config/paths.py)
    recipe = write(tmp_path / "r.yaml", {"model": {"hf_config": "m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base"}})
    ok = load_config(recipe, ["parallel.tensor_model_parallel_size=4"])
    assert ok.parallel.tensor_model_parallel_size == 4
    assert "num_attention_heads = 32" in err(tmp_path, ["parallel.tensor_model_parallel_size=3"], recipe=recipe)
    # on the command line the same path is the working directory's, where there is none
    msg = err(tmp_path, ["model.hf_config=m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base"])
    assert f"model.hf_config = '{tmp_path}/m2po_megatron/assets" in msg


def test_missing_files_name_the_fix(tmp_path, monkeypatch):
    """A paper recipe without weights names M2PO_MODELS_DIR and --no-check-files; the tiny recipe on a fresh
    checkout says that `m2po demo` builds the tiny task."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("M2PO_MODELS_DIR", raising=False)
    msg = err(tmp_path, recipe="paper/qwen3-1.7b-base")
    assert "set M2PO_MODELS_DIR" in msg and "--no-check-files" in msg and "M2PO_DATA_DIR" in msg
    assert "deepscaler/eval/math500.jsonl" in msg  # where `prepare-data --out DIR/deepscaler` writes them
    monkeypatch.setattr("m2po_megatron.config.paths.PROJECT_ROOT", tmp_path)  # a fresh checkout: no .cache/
    msg = err(tmp_path, recipe="tiny-cpu")
    assert "the tiny task .cache/tiny-task is built by `m2po demo`" in msg


def test_a_missing_tiny_task_names_the_command_that_builds_that_directory(tmp_path, monkeypatch):
    """The toy sweep's task is .cache/tiny-task-toy, which `make toy-table1` builds, not `m2po demo`; any
    other tiny-task directory gets the builder's own command line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("m2po_megatron.config.paths.PROJECT_ROOT", tmp_path)  # a fresh checkout, run from its root
    toy = ["model.hf_path=.cache/tiny-task-toy", "data.train_path=.cache/tiny-task-toy/train.jsonl",
           "data.eval_paths=[.cache/tiny-task-toy/eval.jsonl]"]
    msg = err(tmp_path, toy, recipe="tiny-cpu")
    assert "the tiny task .cache/tiny-task-toy is built by `make toy-table1`" in msg and "m2po demo" not in msg
    fair = [o.replace("tiny-task-toy", "tiny-task-fair") for o in toy]
    assert "the tiny task .cache/tiny-task-fair is built by `make toy-table1-fair`" in err(tmp_path, fair,
                                                                                          recipe="tiny-cpu")
    msg = err(tmp_path, recipe="tiny-moe-cpu")  # a MoE task: the builder's --moe, not a dense model
    assert "the tiny task .cache/tiny-task-moe is built by `make demo-moe`" in msg and "--moe" in msg
    other = [o.replace("tiny-task-toy", "tiny-task-seed3") for o in toy]
    msg = err(tmp_path, other, recipe="tiny-cpu")
    assert "`python tools/build_tiny_model.py .cache/tiny-task-seed3 --seed 0`" in msg


def test_layout_errors_and_group_size_one_exit_2_not_a_traceback():
    for args in (["recipes/paper/qwen2.5-math-7b.yaml", "parallel.tensor_model_parallel_size=8"],
                 ["tiny-cpu", "rollout.n_samples_per_prompt=1"]):
        p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "config", *args, "--no-check-files"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "num_attention_heads = 28" in err(None, ["model.hf_config=m2po_megatron/assets/configs/Qwen__Qwen2.5-Math-7B",
                                                    "parallel.tensor_model_parallel_size=8",
                                                    "cluster.gpu_memory_gb=80"])
    assert "GRPO advantages" in err(None, ["rollout.n_samples_per_prompt=1"])


def test_config_prints_the_memory_estimate_and_takes_overrides_after_options():
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "config", "paper/qwen3-8b-base",
                        "--no-check-files", "train.steps=3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "steps: 3" in p.stdout  # an override after an option still applies
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("# memory estimate per trainer GPU: weights") and last.endswith(" GiB"), last
    assert yaml.safe_load(p.stdout)["train"]["steps"] == 3  # still a valid recipe
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "config", "tiny-cpu", "--bogus", "train.steps=3"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr


def test_layout_check_is_the_builders(tmp_path):
    """The config refuses every split the model builder refuses (one check, m2po_megatron.models.layout), with
    the same message naming the config field, before anything starts."""
    from m2po_megatron.models import read_hf_config, validate_layout

    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 385}
    (tmp_path / "config.json").write_text(json.dumps(config))
    msg = err(tmp_path, [f"model.hf_config={tmp_path}", "parallel.tensor_model_parallel_size=2"])
    assert "vocab_size = 385 (model config) is not divisible by parallel.tensor_model_parallel_size = 2" in msg
    with pytest.raises(ValueError, match="vocab_size = 385 .* not divisible by tensor_model_parallel_size = 2"):
        validate_layout(read_hf_config(config), 2, 1)
    ok = load_config(None, [f"model.hf_config={tmp_path}", "parallel.tensor_model_parallel_size=1"])
    validate_layout(read_hf_config(config), ok.parallel.tensor_model_parallel_size, 1)  # both accept TP 1


def test_overrides_follow_omegaconf_dotlist_and_name_the_bad_item():
    """Overrides are parsed by OmegaConf's dotlist grammar (a later override of a key wins); a bad one names
    the item and the fix."""
    cfg = load_config(None, ["train.steps=5", "train.steps=7", "+algo.m2po.tau=0.5", "algo.m2po={rule: cap}",
                             "run.name=2026-12-01", "data.eval_paths=[a.jsonl, b.jsonl]"], check_files=False)
    assert cfg.train.steps == 7 and cfg.algo.m2po.rule == "cap" and cfg.run.name == "2026-12-01"
    assert cfg.algo.m2po.tau == 0.5  # a section override merges with an earlier override of one of its fields
    assert list(cfg.data.eval_paths) == [os.path.abspath("a.jsonl"), os.path.abspath("b.jsonl")]  # the cwd's
    assert "must look like section.field=value" in err(None, ["train.steps"])
    assert "has no key" in err(None, ["=3"])
    assert "not valid YAML" in err(None, ["train.steps=["])
    assert "unknown key 'algo.m2po.tua'; did you mean 'algo.m2po.tau'?" in err(None, ["algo.m2po.tua=1"])
    assert "'train.steps' has the wrong type" in err(None, ["train.steps=abc"])
