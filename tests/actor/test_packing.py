"""Pure packing logic: no processes (model_inputs builds megatron's PackedSeqParams, nothing else of Megatron)."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from m2po_megatron.actor.batch import TrainBatch
from m2po_megatron.actor.packing import (build_microbatch, pack_by_token_budget, padded_batching_waste,
                                         padding_waste, plan_microbatches, shard_for_dp, split_minibatches)


def _batch(lens, plen=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 50, (n,), generator=g) for n in lens]
    return TrainBatch(ids, [plen] * len(lens), [torch.zeros(n - plen) for n in lens], torch.ones(len(lens)))


def test_split_minibatches_contiguous_and_even():
    assert split_minibatches(10, 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split_minibatches(2, 3) == [[0], [1], []]  # the empty one is skipped by the actor
    with pytest.raises(ValueError, match="num_minibatches"):
        split_minibatches(2, 0)


def test_shard_for_dp_is_a_balanced_partition():
    rng = random.Random(0)
    lens = [rng.randint(5, 200) for _ in range(37)]
    shards = shard_for_dp(lens, 4)
    assert sorted(i for s in shards for i in s) == list(range(37))
    loads = [sum(lens[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lens)
    assert shard_for_dp(lens, 4) == shards  # deterministic
    assert shard_for_dp([3], 2) == [[0], []]  # a rank without a sequence: dp_share gives it a filler
    with pytest.raises(ValueError, match="dp_size"):
        shard_for_dp([3], 0)


def test_pack_respects_budget_and_covers_all():
    rng = random.Random(1)
    lens = [rng.randint(1, 100) for _ in range(50)]
    bins = pack_by_token_budget(lens, 128)
    assert sorted(i for b in bins for i in b) == list(range(50))
    assert all(sum(lens[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= 2 * (sum(lens) // 128 + 1)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_by_token_budget([200], 128)


def test_microbatch_layout_positions_labels_and_mask():
    b = _batch([5, 4], plen=2)
    mb = build_microbatch(b, [0, 1], pad_multiple=4)
    assert mb.seq_len == 12 and mb.num_padding == 3
    assert mb.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert torch.equal(mb.tokens[0, :5], b.input_ids[0]) and torch.equal(mb.tokens[0, 5:9], b.input_ids[1])
    # response tokens 2..4 of seq0 are predicted at positions 1..3, seq1 tokens 2..3 at 6..7
    assert mb.logprob_positions.tolist() == [1, 2, 3, 6, 7]
    assert torch.equal(mb.labels[0, mb.logprob_positions], torch.cat([b.input_ids[0][2:], b.input_ids[1][2:]]))
    m = mb.attention_mask()[0, 0]
    assert not m[4, 0] and m[0, 1] and m[5, 4] and not m[8, 5]  # causal inside, blocked across
    assert mb.cu_seqlens().tolist() == [0, 5, 9, 12]


def test_packer_waste_below_padded_batching():
    rng = random.Random(2)
    lens = [min(4096, int(rng.lognormvariate(6.5, 0.7))) + 1 for _ in range(256)]
    b = _batch(lens, plen=1)
    mbs = plan_microbatches(b, list(range(256)), 8192, pad_multiple=2)
    assert padding_waste(mbs) < 0.01
    assert padded_batching_waste(lens, 8192) > padding_waste(mbs)


def test_batch_validation_names_fields():
    b = _batch([5, 4], plen=2)
    b.validate(for_training=True, vocab_size=50)
    bad = _batch([5, 4], plen=2)
    bad.behav_log_probs[1] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"behav_log_probs\[1\]"):
        bad.validate(for_training=True)
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]"):
        TrainBatch([torch.arange(3)], [3]).validate(for_training=False)
    with pytest.raises(ValueError, match="outside"):
        b.validate(for_training=False, vocab_size=10)
    sub = b.select([1])
    assert len(sub) == 1 and sub.advantages.shape == (1,)


@pytest.mark.parametrize("backend", ["te", "sdpa", "local"])
def test_model_inputs_go_to_the_given_device(backend):
    """The one place that puts a row on the model's device, checked on the meta device (which the CPU layer
    never rewrites, unlike 'cuda'): token ids, positions and the mask, or the packed row's document ids (and
    TE's cu_seqlens), land there; the row's sequence bounds stay host ints, read once per micro-batch."""
    import torch

    from m2po_megatron.actor.packing import build_microbatch, model_inputs

    b = TrainBatch([torch.arange(5), torch.arange(3)], [2, 1])
    mb = build_microbatch(b, [0, 1]).padded_to(10)
    inp = model_inputs(mb, torch.device("meta"), backend)
    assert inp["input_ids"].device.type == "meta" and inp["position_ids"].device.type == "meta"
    assert inp["input_ids"].shape == (1, 10)
    psp = inp["packed_seq_params"]
    if backend == "local":
        assert psp is None and inp["attention_mask"].device.type == "meta"
        assert inp["attention_mask"].shape == (1, 1, 10, 10)
    else:  # a models.attention.PackedRow: megatron sees one [s, 1] sequence; bounds stay on the host
        assert inp["attention_mask"] is None and psp.qkv_format == "sbhd"
        assert psp.bounds == (0, 5, 8, 10)  # trailing padding is its own segment
        assert psp.document_ids.device.type == "meta" and psp.max_seqlen_q == 5
        if backend == "te":  # Transformer Engine's kernels read cu_seqlens on the device
            assert psp.thd.qkv_format == "thd" and psp.thd.cu_seqlens_q.device.type == "meta"
            assert psp.thd.max_seqlen_q == 5
        else:
            assert psp.thd is None
    with pytest.raises(ValueError, match="attention_backend"):
        model_inputs(mb, "cpu", "flash")


def _te_fp8_gemm_accepts(shape) -> bool:
    """Transformer Engine's FP8 GEMM input check (transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec):
    the product of all dims but the last divisible by 8, the last divisible by 16."""
    lead = 1
    for d in shape[:-1]:
        lead *= d
    return lead % 8 == 0 and shape[-1] % 16 == 0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("fp8, recipe", [(False, None), (True, "tensorwise"), (True, "delayed"), (True, "mxfp8")])
def test_ragged_rows_are_padded_as_te_fp8_and_sequence_parallelism_need(tp, sp, fp8, recipe):
    """Ragged rows built as the actor builds them (row_multiple): with sequence parallelism every rank gets an
    equal share; with FP8 every linear layer's input on each rank ([local tokens, hidden] forward, and the
    transposed [hidden, local tokens] of the weight-gradient GEMM) passes TE's FP8 check, and MXFP8's
    32-element blocks tile the tokens; without either nothing is padded. Positions, labels and cu_seqlens
    stay those of the unpadded sequences, and the padding is a segment of its own."""
    from m2po_megatron.actor.packing import model_inputs, row_multiple

    rng = random.Random(tp * 7 + sp)
    lens = [rng.randint(4, 300) for _ in range(40)]
    assert any(n % 16 for n in lens)
    b = _batch(lens, plen=3)
    hidden, ffn = 2048, 6144  # Qwen3-1.7B's sizes, divisible by 16 x TP as every supported model's are
    mbs = plan_microbatches(b, list(range(len(lens))), 1000, row_multiple(tp, sp, fp8, recipe))
    assert sum(len(m.seq_index) for m in mbs) == len(lens)
    assert any(sum(m.lengths) % 16 for m in mbs)  # really ragged before padding
    for mb in mbs:
        s, used = mb.seq_len, sum(mb.lengths)
        local = s // tp if sp else s  # tokens of each rank entering the column-parallel linears
        if sp:
            assert s % tp == 0
        if fp8:
            for shape in ([local, hidden], [hidden, local], [s, ffn // tp], [ffn // tp, s]):
                assert _te_fp8_gemm_accepts(shape), (tp, sp, recipe, s, shape)
            if recipe == "mxfp8":
                assert local % 32 == 0
            assert s - used < row_multiple(tp, sp, fp8, recipe)  # the least padding that does it
        if not fp8 and not sp:
            assert s == used and mb.num_padding == 0
        assert mb.num_padding == s - used
        # the sequences are where they were, and nothing of them moved into the padding
        assert mb.cu_bounds()[:len(mb.lengths) + 1] == [sum(mb.lengths[:k]) for k in range(len(mb.lengths) + 1)]
        assert mb.cu_bounds()[-1] == s
        assert int(mb.logprob_positions.max()) < used
        expect = torch.cat([b.input_ids[i][3:] for i in mb.seq_index])
        assert torch.equal(mb.labels[0, mb.logprob_positions], expect)
        assert mb.response_seq_ids().tolist() == [k for k, r in enumerate(mb.response_lens) for _ in range(r)]
        row = model_inputs(mb, "cpu", "te")["packed_seq_params"]
        psp = row.thd  # TE's THD params; the padding is a segment of its own
        assert row.bounds == tuple(mb.cu_bounds()) and psp.cu_seqlens_q.tolist() == mb.cu_bounds()
        assert psp.max_seqlen_q == max(max(mb.lengths), s - used)


def test_row_multiple():
    from m2po_megatron.actor.packing import row_multiple

    assert [row_multiple(tp, False, False) for tp in (1, 2, 8)] == [1, 1, 1]
    assert [row_multiple(tp, True, False) for tp in (1, 2, 8)] == [1, 2, 8]
    assert [row_multiple(tp, False, True, "tensorwise") for tp in (1, 2, 8)] == [16, 16, 16]
    assert [row_multiple(tp, True, True, "delayed") for tp in (1, 2, 8)] == [16, 32, 128]
    assert row_multiple(4, True, True, "mxfp8") == 128


@settings(max_examples=300, deadline=None)
@given(group_size=st.integers(1, 8), groups=st.integers(1, 12), kept=st.data(), dp=st.integers(1, 8),
       updates=st.integers(1, 6), lens=st.data(), weighted=st.booleans())
def test_every_rank_has_a_well_defined_share_of_any_filtered_batch(group_size, groups, kept, dp, updates, lens,
                                                                   weighted):
    """Issue 35: whatever dynamic sampling keeps (any subset of the groups), at any DP size and number of
    updates, the mini-batches partition the batch in order; within each, the ranks' shares partition its
    sequences; a rank with none gets exactly one filler whose tokens all weigh 0; the real sequences and
    tokens over all ranks are the mini-batch's."""
    from m2po_megatron.actor.dp_share import rank_share

    survive = kept.draw(st.lists(st.booleans(), min_size=groups, max_size=groups), label="filter outcome")
    n = sum(survive) * group_size
    seq_lens = lens.draw(st.lists(st.integers(2, 30), min_size=n, max_size=n), label="lengths")
    batch = _batch(seq_lens, plen=1) if n else TrainBatch([], [], [], torch.ones(0))
    if weighted and n:
        batch.loss_weights = [torch.full((L - 1,), 0.5) for L in seq_lens]
    minis = split_minibatches(n, updates)
    assert [i for m in minis for i in m] == list(range(n)) and len(minis) == updates
    assert max(map(len, minis)) - min(map(len, minis)) <= 1
    for mi in minis:
        if not mi:
            continue  # skipped by every rank alike
        mb = batch.select(mi)
        real, tokens = [], 0
        for r in range(dp):
            ext, _, shard, filler = rank_share(mb, dp, r)
            assert shard and filler == (shard == [len(mb)])
            if filler:
                assert len(ext) == len(mb) + 1 and ext.loss_weights[-1].eq(0).all() and ext.response_lens[-1] == 1
                ext.validate(for_training=True, vocab_size=64)
                assert all(torch.equal(a, b) for a, b in zip(ext.input_ids, mb.input_ids))  # the real ones as given
            else:
                assert ext is mb
                real += shard
                tokens += sum(mb.response_lens[i] for i in shard)
        assert sorted(real) == list(range(len(mb))) and tokens == sum(mb.response_lens)
        assert sum(not rank_share(mb, dp, r)[3] for r in range(dp)) == min(dp, len(mb))
