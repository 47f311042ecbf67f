"""The one interface the loop sees: both generators satisfy `Generator`, and its verbs do what the loop's
direct reaches into them did (the controller driven exactly as before, pause around a weight push, the
reward counters and generated tokens read once per step)."""
import pytest

from m2po_megatron.data.prompts import PromptStream, Tokenize
from m2po_megatron.data.rows import TaskRow
from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer
from m2po_megatron.reward import RewardInput, Rewards
from m2po_megatron.reward.functions import terms_of
from m2po_megatron.rollout.client import SampleResult
from m2po_megatron.rollout.generators import AsyncGenerator, Generator, GroupMaker, SyncGenerator
from m2po_megatron.rollout.groups import informative
from m2po_megatron.rollout.updates import WeightUpdater
from m2po_megatron.staleness import FixedLagQueue, SampleLedger, StalenessController

ROWS = [{"id": f"r{i}", "prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]
N = 2


def tasks(tok) -> list[TaskRow]:
    """ROWS as load_data gives them (text prompts without a chat template)."""
    return [TaskRow(r["id"], tok(r["prompt"], add_special_tokens=False)["input_ids"], r["prompt"], r, r["answer"])
            for r in ROWS]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def math_rewards() -> Rewards:
    return Rewards(terms_of({"function": "math_verify"}), num_workers=1, timeout_s=20.0)


def maker(tok, rewards=None) -> GroupMaker:
    return GroupMaker(None, rewards, tok, Tokenize(tok, 64), {"temperature": 1.0}, n=N, seed=0)


def controller() -> StalenessController:
    return StalenessController(2, groups_per_step=2, updates_per_step=2, sync_interval=2)


def async_gen(tok) -> AsyncGenerator:
    return AsyncGenerator(maker(tok), PromptStream(tasks(tok), 0), SampleLedger(), controller(), 2)


def test_both_generators_satisfy_the_protocol(tok):
    sync = SyncGenerator(maker(tok), PromptStream(tasks(tok), 0), SampleLedger(), 2, FixedLagQueue(1, 2))
    for gen in (sync, async_gen(tok)):
        assert isinstance(gen, Generator), type(gen).__name__
    assert not isinstance(object(), Generator)  # the check does look at the methods


def take_batch(ctl: StalenessController, tag: str) -> None:
    """Admission, generation and one batch taken, as the generator does them."""
    ids = [f"{tag}/{i}" for i in range(ctl.capacity())]
    ctl.try_admit(ids)
    for gid in ids:
        ctl.on_generated(gid, ctl.server_version)
    ctl.on_consumed(ctl.select_batch())


def test_on_step_and_on_sync_drive_the_controller_as_before(tok):
    gen, direct = async_gen(tok), controller()
    version = 0
    for step, applied in enumerate((2, 0, 2)):  # the loop's sequence over 3 steps: one trained nothing
        for ctl in (gen.ctl, direct):
            take_batch(ctl, f"s{step}")
        version += applied
        gen.on_step(version, updates=applied)  # what the loop calls now
        direct.on_step(version, updates=applied)  # what it called before
        assert gen.needs_sync() == direct.needs_sync()
        if gen.needs_sync():
            gen.on_sync(version)
            direct.on_sync(version)
        assert gen.ctl.state_dict() == direct.state_dict()
    assert gen.ctl.server_version == version == 4


def test_sync_generator_always_syncs_and_has_nothing_to_pause(tok):
    gen = SyncGenerator(maker(tok), PromptStream(tasks(tok), 0), SampleLedger(), 2)
    before = gen.state_dict()
    gen.start(), gen.pause(), gen.on_step(2, updates=2), gen.on_sync(2), gen.resume()
    assert gen.needs_sync() and gen.state_dict() == before and gen.pending() == 0
    with gen.locked():  # the loop's ledger lock is the generator's
        assert gen.lock.locked()


def test_stats_are_read_once_per_step(tok):
    with math_rewards() as pool:
        m = maker(tok, pool)
        g = m.new_group("g0", tasks(tok)[0])
        out = [SampleResult(output_ids=tok(t, add_special_tokens=False)["input_ids"], output_logprobs=[],
                            token_versions=[], finish_reason="stop", prompt_tokens=3, weight_version=0)
               for t in (r"\boxed{1}", "no idea")]
        for s, o in zip(m.fill(g, out).samples, out):
            s.logprobs, s.versions = [-1.0] * len(o.output_ids), [0] * len(o.output_ids)
        m.score([g])
        gen = SyncGenerator(m, PromptStream(tasks(tok), 0), SampleLedger(), 1)
        first = gen.stats(since=0.0)
        assert first.rewards and sum(v for k, v in first.rewards.items() if k.startswith("reward/")) > 0
        assert first.tokens_per_s > 0
        again = gen.stats(since=0.0)  # nothing new since the previous call
        assert again.rewards == {} and again.tokens_per_s == 0.0
        scored = gen.eval_rewards().score([RewardInput(r"\boxed{2}", [], {"answer": "2"}),
                                           RewardInput("x", [], {"answer": "2"})])  # the same pool, for evaluation
        assert [s.score for s in scored] == [1.0, 0.0]
        assert gen.stats(since=0.0).rewards == {}  # evaluation leaves the training counters alone


class RecordingRanks:
    """Stands in for the trainer ranks' `call` (a Ray round trip): records what the generator looked like
    while the weights were pushed."""

    def __init__(self, gen):
        self.gen, self.calls = gen, []

    def call(self, method, *args, **kwargs):
        self.calls.append((method, args, self.gen.paused.is_set(), self.gen.ctl.server_version))
        return [{"seconds": 0.5, "bytes": 10, "note": "not a number"}]


def test_weight_push_pauses_admission_and_tells_the_controller(tok):
    gen = async_gen(tok)
    ranks = RecordingRanks(gen)
    weights = WeightUpdater(None, ranks, None, ["http://unused"])
    weights.attach(gen)
    take_batch(gen.ctl, "a")
    gen.on_step(2, updates=2)
    stats = weights.push(2)
    assert ranks.calls == [("sync_weights", (2,), True, 0)]  # paused during the push, controller told after
    assert not gen.paused.is_set() and gen.ctl.server_version == 2 and weights.synced == 2
    assert stats == {"weight_sync/seconds": 0.5, "weight_sync/bytes": 10}
    weights.watch_restarts()
    assert weights.resync_restarted(2) == {}  # attached servers (no launcher): nothing restarts them


def test_a_failed_push_still_resumes_generation(tok):
    gen = async_gen(tok)

    class Failing:
        def call(self, *a, **k):
            raise RuntimeError("sync failed")

    weights = WeightUpdater(None, Failing(), None, [])
    weights.attach(gen)
    with pytest.raises(RuntimeError):
        weights.push(2)
    assert not gen.paused.is_set() and weights.synced == 0


def test_locked_is_the_lock_the_generation_thread_takes(tok):
    gen = async_gen(tok)
    assert gen.locked() is gen.lock  # _admit, _finish and next_groups take it


def _results(tok, texts, version=0):
    return [SampleResult(output_ids=tok(t, add_special_tokens=False)["input_ids"], output_logprobs=[-1.0],
                         token_versions=[version], finish_reason="stop", prompt_tokens=3, weight_version=version)
            for t in texts]


def test_bounded_filter_groups_drops_uniform_groups_and_takes_a_short_batch_when_the_budget_is_spent(tok):
    """max_gen_batches=1, 2 groups per step: an all-wrong group is dropped as it finishes (ledger
    zero_variance, its admission slot freed for a replacement); after 2 finished groups the one informative
    group is trained as a short batch instead of waiting for a second."""
    with math_rewards() as pool:
        ledger = SampleLedger()
        gen = AsyncGenerator(maker(tok, pool), PromptStream(tasks(tok), 0), ledger, controller(), 2, max_gen_batches=1)
        admitted = gen._admit()
        capacity = gen.ctl.capacity()
        uniform, mixed = admitted[0], admitted[1]
        gen._finish(uniform, _results(tok, ["no idea", "none"]))  # both wrong: zero variance
        assert ledger.counters()["samples/dropped/zero_variance"] == N and gen.ctl.capacity() == capacity + 1
        assert uniform.group_id not in gen.finished
        with pytest.raises(TimeoutError):  # 1 finished group, budget not spent yet: wait for a full batch
            gen.next_groups(0, timeout_s=0.01)
        answer = mixed.answer
        gen._finish(mixed, _results(tok, [rf"\boxed{{{answer}}}", "no idea"]))
        batch = gen.next_groups(0, timeout_s=5)
        assert [g.group_id for g in batch] == [mixed.group_id]
        with gen.locked():
            ledger.check(gen.pending() + len(batch[0].samples))  # the batch is pending until the loop consumes it
        stats = gen.stats(since=0.0).extra
        assert stats["filter_groups/dropped_groups"] == 1 and stats["filter_groups/kept_groups"] == 1
        assert stats["filter_groups/dropped_frac"] == 0.5


def test_informative_means_unequal_rewards_among_scored_samples(tok):
    from m2po_megatron.rollout.samples import Group, Sample

    def group(rewards, reasons=None):
        reasons = reasons or ["stop"] * len(rewards)
        return Group("g", "p", [1], "1", [Sample(f"g/{i}", "g", [1], [2], [0.0], [0], r, "1", reward=w)
                                          for i, (w, r) in enumerate(zip(rewards, reasons))])

    for metric in ("acc", "seq_reward"):
        assert not informative(group([1.0, 1.0, 1.0]), metric)
        assert not informative(group([0.0, 0.0]), metric)
        assert informative(group([0.0, 1.0]), metric)
        assert informative(group([1.0]), metric)  # one scored sample: build_step_batch decides
        assert not informative(group([1.0, 0.0, 1.0], ["stop", "abort", "stop"]), metric)  # the abort is not scored
    # reward.format_score 0.1: a boxed wrong answer and no answer differ in reward, not in accuracy (verl's
    # "acc" drops the group: all wrong; "seq_reward" keeps it)
    assert not informative(group([0.1, 0.0, 0.1]), "acc") and informative(group([0.1, 0.0, 0.1]), "seq_reward")
    assert GroupMaker(None, None, None, None, {}, n=2, seed=0, filter_metric="seq_reward").informative(
        group([0.1, 0.0]))
    with pytest.raises(ValueError, match="train.filter_groups.metric must be one of"):
        informative(group([0.0, 1.0]), "score")


def test_bounded_filter_groups_never_waits_past_its_budget_and_a_resume_keeps_the_count(tok):
    """Issue 35: every group of a bounded step's budget is uniform. The step then takes an empty batch
    (fixed_lag does the same) instead of waiting without bound; the count of finished groups is in the
    checkpoint, so a generator restored after one uniform group takes its empty batch at the same point as
    the uninterrupted one. max_num_gen_batches = 0 is verl's "no limit": it waits."""
    import json

    def uniform(gen, group):
        gen._finish(group, _results(tok, ["no idea", "none"]))

    with math_rewards() as pool:
        ledger = SampleLedger()
        gen = AsyncGenerator(maker(tok, pool), PromptStream(tasks(tok), 0), ledger, controller(), 2, max_gen_batches=1)
        first, second = gen._admit()[:2]
        uniform(gen, first)
        assert gen.finished_since_batch == 1
        with pytest.raises(TimeoutError):
            gen.next_groups(0, timeout_s=0.01)  # budget (1 batch = 2 groups) not spent yet
        state = json.loads(json.dumps(gen.state_dict()))  # as a checkpoint stores it, with the ledger
        assert state["finished_since_batch"] == 1
        ledger2 = SampleLedger()
        ledger2.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
        resumed = AsyncGenerator(maker(tok, pool), PromptStream(tasks(tok), 0), ledger2, controller(), 2,
                                 max_gen_batches=1)
        resumed.load_state_dict(state)  # the in-flight group is dropped (interrupted) and regenerated first
        assert resumed.finished_since_batch == 1
        for g in (gen, resumed):
            one = second if g is gen else g._admit()[0]
            uniform(g, one)
            assert g.next_groups(0, timeout_s=5) == []  # the budget is spent: an empty batch, no wait
            g.on_step(0, updates=0)  # the loop: nothing trained, the controller takes the updates back
            assert g.finished_since_batch == 0 and g.ctl.state_dict()["version"] == 0
        unlimited = AsyncGenerator(maker(tok, pool), PromptStream(tasks(tok), 0), SampleLedger(), controller(), 2,
                                   max_gen_batches=0)
        for group in unlimited._admit()[:2]:
            uniform(unlimited, group)
        with pytest.raises(TimeoutError):
            unlimited.next_groups(0, timeout_s=0.01)


class RestartedServer:
    """Stands in for the launcher's restart counts (EngineManager.info) and the trainer ranks' `call`: one
    server, restarted once; the re-synced server answers what is in flight with the pushed version."""

    def __init__(self, gen, tok):
        self.gen, self.tok, self.restarts, self.calls = gen, tok, 0, []

    def info(self):
        return [{"url": "http://unused", "alive": True, "restarts": self.restarts, "log": "-"}]

    def call(self, method, *args, **kwargs):
        self.calls.append(method)
        if method == "sync_weights":
            for group in list(self.gen.inflight.values()):
                self.gen._finish(group, _results(self.tok, [r"\boxed{1}", "no idea"], args[0]))
            return [{"seconds": 0.1}]
        return [None]


def test_a_server_restarted_while_the_loop_waits_is_resynced_by_the_wait(tok, tmp_path, monkeypatch):
    """The CI failure of 2026-12-04: a bounded run's server restarts (base weights) while the loop waits
    for a batch. Its answers are older than the bound allows and are dropped, so no batch can come until
    the servers are re-synced; the wait notices the restart and re-syncs, and the step's metrics count it.
    Without a restart the wait ends at cluster.timeout_s with a RunError naming it."""
    from m2po_megatron import train
    from m2po_megatron.config import load_config
    from m2po_megatron.infra.errors import RunError
    from m2po_megatron.run.state import CheckpointManager

    monkeypatch.setattr(train, "RESTART_POLL_S", 0.05)
    with math_rewards() as pool:
        cfg = load_config(None, ["staleness.mode=bounded", "cluster.timeout_s=30"], check_files=False)
        ledger = SampleLedger()
        gen = AsyncGenerator(maker(tok, pool), PromptStream(tasks(tok), 0), ledger, controller(), 2)
        server = RestartedServer(gen, tok)
        weights = WeightUpdater(cfg, server, server, [])
        weights.attach(gen)
        weights.watch_restarts()
        for group in gen._admit()[:2]:  # a first step, trained on base-weight answers
            gen._finish(group, _results(tok, [r"\boxed{1}", "no idea"], 0))
        assert len(gen.next_groups(0, timeout_s=5)) == 2
        gen.on_step(2, updates=2)
        gen.on_sync(2)  # the servers held version 2 ...
        for group in gen._admit():  # ... then one restarted, with the base weights, and answered these
            gen._finish(group, _results(tok, [r"\boxed{1}", "no idea"], 0))
        assert ledger.counters()["samples/dropped/aborted"] > 0 and not gen.finished
        for group in gen._admit():  # their replacements are in flight
            assert group.group_id in gen.inflight
        ckpts = CheckpointManager(tmp_path)

        server.restarts = 1
        groups, resynced = train.next_batch(cfg, gen, weights, 2, ckpts)
        assert server.calls == ["init_weight_sync", "sync_weights"]  # a new group with the restarted server
        assert resynced["rollout/server_restarts"] == 1 and resynced["weight_sync/seconds"] == 0.1
        assert len(groups) == 2 and all(v == 2 for g in groups for s in g.samples for v in s.versions)

        while gen.take_batch():  # what the re-synced server answered beyond this batch
            pass
        quick = load_config(None, ["staleness.mode=bounded", "cluster.timeout_s=0.2"], check_files=False)
        with pytest.raises(RunError, match=r"no batch within cluster.timeout_s = 0 s.*start again"):
            train.next_batch(quick, gen, weights, 2, ckpts)
        assert server.calls == ["init_weight_sync", "sync_weights"]  # no restart since: nothing re-synced
