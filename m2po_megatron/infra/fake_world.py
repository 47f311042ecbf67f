"""A fake world for real-size checks without a GPU (m2po rehearse, convert.layout_check, the contract suite's
weight names): torch's fake process group at any world size, fake tensors with an allocator model, and a log of
every collective.

The seams, all here and all named (nothing of the training step is re-implemented):
- an op whose tensor inputs are all real (the batch's own tensors: its checks, packing, advantages) runs for
  real; anything that touches a fake tensor (the model, its weights, every factory call) is fake.
- host reads (`.item()`, `.tolist()`: aten._local_scalar_dense) have no value under fake tensors; they return 0
  (False, 0, 0.0). So every NaN/inf count is 0, a grad norm is 0 and the optimizer step is taken.
- data-dependent shapes (aten.nonzero) take their upper bound: every element counts as nonzero; a real boolean
  mask used as an index is replaced by its real positions first.
- object collectives (all_gather_object, broadcast_object_list, gather_object) carry no data over the fake
  group: every rank is taken to hold this rank's object (the SPMD assumption), and a non-source rank's None
  in broadcast_object_list becomes {} (an empty metrics dict). Their pickled size is logged.
- Megatron's gloo groups are built on the fake backend too (gloo cannot run over the fake group's store).
- tensor collectives and point-to-point calls are logged with their process group's Megatron name and bytes,
  and not run (the fake backend moves no data either, and has no fake implementation of the coalesced ones).
  An all-gather of a *real* tensor (a count, e.g. the MoE dispatcher's tokens per expert) fills its output with
  this rank's tensor on every rank (the SPMD assumption, as for objects).
- mixture of experts: routing is data (which expert each token picks), and fake tensors have none. The MoE
  dispatcher gets a real, balanced routing map instead (`balanced_moe_routing`: token t picks experts
  (t x k + j) mod E, so every expert receives T x k / E tokens), from which its split sizes are real numbers:
  every expert computes on a balanced share of tokens, the expectation the memory formula uses.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from m2po_megatron.infra.fake_cache import FastCacheFakeTensorMode

_aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default
_COPIES = (_aten._to_copy.default, _aten.clone.default)  # ops whose output is a copy of their first input
ALIGN = 512  # the CUDA caching allocator rounds every block up to 512 bytes


def init_fake_world(rank: int, world_size: int) -> None:
    """torch.distributed on the fake backend: any world size in one process, collectives that move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    # Megatron also builds gloo groups (its optimizer uses them); gloo over a FakeStore crashes the process, so
    # every new group is a fake one
    new_group = getattr(c10d.new_group, "_m2po_original", c10d.new_group)

    def fake_new_group(*args, **kwargs):
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        if len(args) > 2:
            args = args[:2] + (None,) + args[3:]  # new_group(ranks, timeout, backend, ...)
        return new_group(*args, **kwargs)

    fake_new_group._m2po_original = new_group
    dist.new_group = c10d.new_group = fake_new_group


def close_fake_world() -> None:
    """Undo init_fake_world: the process group destroyed, torch's new_group back."""
    from torch.distributed import distributed_c10d as c10d

    if dist.is_initialized():
        dist.destroy_process_group()
    original = getattr(c10d.new_group, "_m2po_original", None)
    if original is not None:
        dist.new_group = c10d.new_group = original


@dataclass
class _Block:
    nbytes: int
    kind: str  # the phase it was allocated in, refined by tag()


class RehearsalMode(FastCacheFakeTensorMode):
    """FakeTensorMode that also models the allocator: every new storage is a block of its bytes (rounded to
    ALIGN), live until its storage is collected; the live total's peak and the kinds of the blocks alive at the
    peak (within PEAK_STEP of it) are kept. `phase` names the kind of what is allocated now. Its dispatch cache
    is looked up by a cheap key first (infra.fake_cache; `fast_cache=False` is torch's cache alone)."""

    PEAK_STEP = 0.002  # a new breakdown is kept when the peak has grown by this fraction since the last one

    def __init__(self, fast_cache: bool = True, crosscheck: bool = False):
        super().__init__(allow_non_fake_inputs=True, fast_cache=fast_cache, crosscheck=crosscheck)
        self.phase = "weights"
        self.live: dict[int, _Block] = {}
        self.total = 0
        self.peak = 0
        self.peak_phase = ""
        self._snap_at = 0
        self.peak_blocks: dict[int, _Block] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._host: dict[int, weakref.ref] = {}  # untracked storages (host memory on a real machine)
        self._host_copies = ""  # the kind of a copy of one of them (untrack)

    # -------------------------------------------------------------- allocator model
    def _track(self, out) -> None:
        if isinstance(out, torch.Tensor):
            self._add(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._add(o)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live or key in self._host:
            return
        n = st.nbytes()
        if n == 0:
            return
        n = -(-n // ALIGN) * ALIGN
        self.live[key] = _Block(n, self.phase)
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._free(k))
        self.total += n
        if self.total > self.peak:
            self.peak = self.total
            self.peak_phase = self.phase
            if self.peak > self._snap_at * (1 + self.PEAK_STEP):
                self._snap_at = self.peak
                self.peak_blocks = dict(self.live)

    def _free(self, key: int) -> None:
        b = self.live.pop(key, None)
        self._refs.pop(key, None)
        if b is not None:
            self.total -= b.nbytes

    def tag(self, tensors, kind: str) -> None:
        """Set the kind of the blocks behind `tensors` (already allocated), also in the peak's breakdown."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                b = self.live.get(id(t.untyped_storage()))
                if b is not None:
                    b.kind = kind

    def untrack(self, tensors, copies_kind: str = "") -> int:
        """Leave the storages behind `tensors` out of the model from now on: they are host memory on a real
        machine (pinned CPU tensors), not GPU blocks. Their bytes leave the live total and the peak's
        breakdown (the peak itself is what it was: reset_peak starts it again). A copy of one of them made
        later (`.to(device, copy=True)`, clone) is a block of kind `copies_kind` ("" : the phase's). Returns the
        bytes untracked."""
        freed = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self._host:
                continue
            b = self.live.get(key)
            if b is not None:
                freed += b.nbytes
                self._free(key)
                self.peak_blocks.pop(key, None)
            self._host[key] = weakref.ref(st, lambda _r, k=key: self._host.pop(k, None))
        if copies_kind:
            self._host_copies = copies_kind
        return freed

    def reset_peak(self) -> None:
        """Start the peak again from the live total (e.g. after untracking what the build made on the host)."""
        self.peak = self._snap_at = self.total
        self.peak_phase = self.phase
        self.peak_blocks = dict(self.live)

    @contextlib.contextmanager
    def peak_within(self):
        """Yields a dict that gets the peak bytes of the block ("peak_bytes") and the kinds at it ("at_peak");
        the mode's own peak after the block is the larger of before and within, as without it."""
        saved = (self.peak, self._snap_at, self.peak_phase, self.peak_blocks)
        self.reset_peak()
        out: dict = {}
        try:
            yield out
        finally:
            out.update(peak_bytes=self.peak, at_peak=self.breakdown())
            if saved[0] >= self.peak:
                self.peak, self._snap_at, self.peak_phase, self.peak_blocks = saved

    def breakdown(self) -> dict[str, int]:
        """Bytes per kind of the blocks alive at the peak."""
        out: dict[str, int] = {}
        for b in self.peak_blocks.values():
            out[b.kind] = out.get(b.kind, 0) + b.nbytes
        return out

    def live_bytes(self) -> int:
        return self.total

    @contextlib.contextmanager
    def saved_as_activations(self):
        """Blocks that autograd saves for backward become 'activations' (the rest of the step: temporaries)."""

        def pack(t):
            b = self.live.get(id(t.untyped_storage())) if isinstance(t, torch.Tensor) else None
            if b is not None and b.kind == "temporaries":
                b.kind = "activations"
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    # -------------------------------------------------------------- dispatch
    @staticmethod
    def _all_real(args, kwargs) -> bool:
        """Whether the op has tensor inputs and none is fake (aten ops take tensors as arguments or in lists
        of them; a hand-written scan: this runs for every op)."""
        seen = False
        for a in (*args, *(kwargs.values() if kwargs else ())):
            if isinstance(a, torch.Tensor):
                if isinstance(a, FakeTensor):
                    return False
                seen = True
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        if isinstance(x, FakeTensor):
                            return False
                        seen = True
        return seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], FakeTensor):  # over half of all calls: answer it first
            return args[0].fake_device
        if self._all_real(args, kwargs):  # the batch's own tensors: real values, checked for real
            with _disable_current_modes():
                out = func(*args, **(kwargs or {}))
            self._track(out)
            return out
        if func is _aten._local_scalar_dense.default:  # a host read: no value exists (see the module docstring)
            dt = args[0].dtype
            return False if dt == torch.bool else (0.0 if dt.is_floating_point or dt.is_complex else 0)
        if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and any(
                isinstance(i, torch.Tensor) and not isinstance(i, FakeTensor) and i.dtype == torch.bool
                for i in args[1]):  # a real boolean mask: its real positions (the batch's response masks)
            idx = [i.nonzero(as_tuple=True) if isinstance(i, torch.Tensor) and not isinstance(i, FakeTensor)
                   and i.dtype == torch.bool else (i,) for i in args[1]]
            args = (args[0], [j for group in idx for j in group], *args[2:])
        if func is _aten.nonzero.default:  # data-dependent size: its upper bound
            x = args[0]
            with self:
                out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
            return out
        out = self.dispatch(func, types, args, kwargs)  # FakeTensorMode.__torch_dispatch__ less its checks
        if not (func._schema.is_mutable or func.is_view):
            self._track(out)
            if self._host_copies and func in _COPIES and id(args[0].untyped_storage()) in self._host:
                self.tag([out], self._host_copies)  # a host tensor's copy to the device (its block may have
                # been made by a decomposition's empty_strided, in the phase's kind)
        return out


# ------------------------------------------------------------------ collectives
@dataclass
class CollectiveLog:
    """Every collective of the rehearsed step: (call, group name, bytes), in order."""

    calls: list[tuple[str, str, int]] = field(default_factory=list)
    names: dict = field(default_factory=dict)  # ProcessGroup -> Megatron's name for it

    def name_groups(self) -> None:
        from megatron.core import parallel_state as ps

        getters = [("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
                   ("dp", ps.get_data_parallel_group),
                   ("dp_cp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
                   ("mp", ps.get_model_parallel_group), ("embedding", ps.get_embedding_group),
                   ("position_embedding", ps.get_position_embedding_group),
                   ("tp_dp", ps.get_tensor_and_data_parallel_group),
                   ("tp_dp_cp", lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
                   ("cp", ps.get_context_parallel_group),
                   # mixture of experts: expert parallel, expert tensor parallel, their product, expert DP
                   ("ep", ps.get_expert_model_parallel_group), ("etp", ps.get_expert_tensor_parallel_group),
                   ("etp_ep", ps.get_expert_tensor_and_model_parallel_group),
                   ("edp", ps.get_expert_data_parallel_group)]
        for name, get in getters:
            try:
                g = get()
            except Exception:  # a group Megatron did not build for this layout
                continue
            if g is not None:
                self.names.setdefault(g, name)

    def group_name(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self.names.get(group, f"group(size {dist.get_world_size(group)})")

    def summary(self) -> list[dict]:
        """Calls of one kind on one group merged: [{call, group, count, bytes}]."""
        agg: dict[tuple[str, str], list[int]] = {}
        for call, group, n in self.calls:
            c = agg.setdefault((call, group), [0, 0])
            c[0] += 1
            c[1] += n
        return [dict(call=k[0], group=k[1], count=v[0], bytes=v[1]) for k, v in agg.items()]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(i) for i in x)
    return 0


_TENSOR_CALLS = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "_reduce_scatter_base",
                 "_all_gather_base", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv",
                 "isend", "irecv", "all_to_all_single", "all_to_all", "gather", "scatter", "barrier")


def _tile_real(out, inp) -> None:
    """An all-gather of real tensors: every rank holds this rank's tensor."""
    if isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and not isinstance(out, FakeTensor) \
            and not isinstance(inp, FakeTensor) and inp.numel() and out.numel() % inp.numel() == 0:
        with _disable_current_modes():
            out.view(-1, inp.numel()).copy_(inp.reshape(1, -1).expand(out.numel() // inp.numel(), -1))


def balanced_routing_map(tokens: int, experts: int, topk: int) -> torch.Tensor:
    """A real [tokens, experts] bool map in which token t routes to experts (t x k + j) mod E, j < k: every
    expert gets tokens x k / E of them (rounded), each token k distinct experts."""
    idx = (torch.arange(tokens).view(-1, 1) * topk + torch.arange(topk).view(1, -1)) % experts
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)


@contextlib.contextmanager
def balanced_moe_routing():
    """For the block, megatron's all-to-all MoE dispatcher routes by balanced_routing_map (module docstring)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    D = td.MoEAlltoAllTokenDispatcher
    original, gather, init = D.dispatch_preprocess, td.gather_from_sequence_parallel_region, D.__init__

    def real_init(self, *args, **kwargs):
        """Megatron's own constructor, outside the fake mode: its chunk-sorting indices (an arange, read on the
        host by .tolist() in every step) must hold values, or every chunk index reads as 0."""
        with _disable_current_modes():
            init(self, *args, **kwargs)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        with _disable_current_modes():
            real = balanced_routing_map(routing_map.shape[0], routing_map.shape[1], self.config.moe_router_topk)
        return original(self, hidden_states, real, probs)

    def gather_counts(input_, *args, group=None, **kwargs):
        """The dispatcher's all-gather of its real token counts: every rank holds this rank's (SPMD)."""
        if isinstance(input_, FakeTensor):
            return gather(input_, *args, group=group, **kwargs)
        with _disable_current_modes():
            return torch.cat([input_] * group.size(), dim=0)

    D.dispatch_preprocess, td.gather_from_sequence_parallel_region = dispatch_preprocess, gather_counts
    D.__init__ = real_init
    try:
        yield
    finally:
        D.dispatch_preprocess, td.gather_from_sequence_parallel_region, D.__init__ = original, gather, init


class _Done:
    """The Work of a collective that has nothing to wait for."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class _DoneCoalescing:
    def __init__(self):
        self.works = []

    def append(self, work):
        pass

    def wait(self):
        pass


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops=False):
    yield _DoneCoalescing()


@contextlib.contextmanager
def logged_collectives(log: CollectiveLog):
    """Replace torch.distributed's collectives, for the block, by calls that log themselves and move nothing
    (the fake backend would move nothing either; several coalesced ops have no fake implementation). Object
    collectives are answered locally (see the module docstring). Modules that imported a collective by name
    (megatron's `from torch.distributed import _coalescing_manager`) get the replacement too."""
    import sys

    from torch.distributed import distributed_c10d as c10d

    def tensor_call(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            first = args[0] if args else next(iter(kwargs.values()), None)
            log.calls.append((name, log.group_name(group), _nbytes(first)))
            if name in ("all_gather_into_tensor", "_all_gather_base") and len(args) >= 2:
                _tile_real(args[0], args[1])
            return _Done() if (kwargs.get("async_op") or name in ("isend", "irecv")) else None
        return call

    def batch_isend_irecv(p2p_op_list):
        works = []
        for op in p2p_op_list:
            works.append(op.op(op.tensor, op.peer, op.group, op.tag))
        return [w or _Done() for w in works]

    def all_gather_object(object_list, obj, group=None):
        log.calls.append(("all_gather_object", log.group_name(group), _pickled_size(obj)))
        for i in range(len(object_list)):
            object_list[i] = obj

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        log.calls.append(("broadcast_object_list", log.group_name(group), _pickled_size(object_list)))
        for i, o in enumerate(object_list):
            if o is None:
                object_list[i] = {}

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        log.calls.append(("gather_object", log.group_name(group), _pickled_size(obj)))
        if object_gather_list is not None:
            for i in range(len(object_gather_list)):
                object_gather_list[i] = obj

    repl = {name: tensor_call(name) for name in _TENSOR_CALLS}
    repl.update(batch_isend_irecv=batch_isend_irecv, all_gather_object=all_gather_object,
                broadcast_object_list=broadcast_object_list, gather_object=gather_object,
                _coalescing_manager=_coalescing_manager)
    originals = {name: getattr(c10d, name) for name in repl}
    by_id = {id(fn): name for name, fn in originals.items()}
    patched: list[tuple[object, str, object]] = []
    # P2POp checks its op against distributed_c10d's isend/irecv: both namespaces get the same replacement
    targets = [c10d, dist] + [m for n, m in list(sys.modules.items()) if n.startswith("megatron") and m is not None]
    try:
        for mod in targets:
            for attr, val in list(vars(mod).items()):
                name = by_id.get(id(val))
                if name is not None and val is originals[name]:
                    patched.append((mod, attr, val))
                    setattr(mod, attr, repl[name])
        yield log
    finally:
        for mod, attr, val in reversed(patched):
            setattr(mod, attr, val)


def _pickled_size(obj) -> int:
    """The bytes an object collective would send: its pickle, a fake tensor counted as its data (fake
    tensors cannot be pickled; e.g. metrics counted in tensors made under the fake mode)."""
    data = 0

    class Sizer(pickle.Pickler):
        def reducer_override(self, o):
            nonlocal data
            if isinstance(o, FakeTensor):
                data += _nbytes(o)
                return tuple, ()
            return NotImplemented

    buf = io.BytesIO()
    Sizer(buf).dump(obj)
    return len(buf.getvalue()) + data


def fake_world_rank(pp_rank: int, tp: int, dp: int, cp: int = 1) -> int:
    """The global rank of (tp 0, cp 0, dp 0, pipeline stage pp_rank) in Megatron's default order tp-cp-ep-dp-pp
    (tensor parallel fastest, pipeline slowest)."""
    return pp_rank * tp * cp * dp


__all__ = ["init_fake_world", "close_fake_world", "RehearsalMode", "CollectiveLog", "logged_collectives",
           "fake_world_rank", "ALIGN"]
