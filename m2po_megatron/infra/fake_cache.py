"""A FakeTensorMode whose dispatch cache is looked up by a cheap key first: the rehearsal's speed.

Under fake tensors nearly all of a rehearsed step's time is op dispatch, and most of a hit in torch's own cache
goes to building its key: every tensor argument's full metadata (17 fields, several of them Python properties
on FakeTensor) extracted and flattened for every op. Megatron's step runs the same few thousand ops on the same
shapes once per micro-batch, so a first-level dictionary keyed by what an output can depend on (each fake
argument's dtype, shape, stride, offset, autograd and conj/neg flags and device; every other
argument's type and value; the default dtype and device; inference mode) finds torch's entry without that work.
On a first-level miss torch's key is built and torch's dispatch runs as usual; its entry, or its decision not to
cache, is kept under the cheap key. On a hit, plain outputs, views (on their input's storage) and in-place
results are built directly, and wrapped as FakeTensor.__new__ wraps them less its argument checks (compared
with torch's constructor at start: torch's is used if they differ). `_unsafe_view` and the splits, which torch
never caches, are cached from the aliasing their first output shows. FakeTensorMode.dispatch's per-op
no_dispatch() context and debug-log call are left out unless torch's fake-tensor log is at DEBUG.

What is not keyable this way (a real tensor among the arguments, symbolic sizes, another mode's fake tensor, a
fake tensor holding a constant, an argument of another type) goes down torch's path unchanged. `crosscheck=N`
dispatches every Nth hit again without a cache and compares the two outputs (metadata, attributes, dispatch
keys, and which arguments they are or share storage with); 1 (or True) checks every hit, 0 none. The tests run
real Megatron steps, dense and mixture-of-experts, that way (`m2po rehearse --fake-cache-crosscheck N`).

This uses FakeTensorMode's private cache API, as torch 2.14 has it (the lock's); without it the mode is torch's.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch._subclasses import fake_tensor as _ft
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                    torch.layout})
_BYPASS = object()  # torch decided not to cache this op with these arguments: dispatch without keying again
_META = torch.device("meta")
_INPLACE, _NEW, _VIEW, _MULTI, _TORCH = range(5)  # what a first-level entry holds: an argument's index; a
# new tensor's (shape, stride, dtype, layout, requires_grad, device); a view's, with the viewed argument's
# index and the offset; a list or tuple of those; or torch's entry (conj/neg outputs: torch builds those)
_aten = torch.ops.aten
# ops torch never caches because their outputs alias an input without being views to it (_unsafe_view) or are
# lists (the splits); their outputs depend on the arguments' metadata alone, so the first output's aliasing
# and metadata hold for every call with the same key
_ALIASING = frozenset({_aten._unsafe_view.default, _aten.split_with_sizes.default, _aten.split.Tensor,
                       _aten.unbind.int})
_HAS_API = all(hasattr(_ft, n) for n in ("_CacheKeyState", "_DispatchCacheValidEntry", "_BypassDispatchCache",
                                          "_DISPATCH_META_HANDLERS", "_DISPATCH_HANDLE_DIRECTLY", "log")) \
    and all(hasattr(FakeTensorMode, n) for n in ("dispatch", "_cached_dispatch_impl", "_cache_key",
                                                   "_output_from_cache_entry", "_dispatch_impl"))


class _NoKey(Exception):
    pass


class FastCacheFakeTensorMode(FakeTensorMode):
    """FakeTensorMode with a first-level dispatch cache under a cheap key (see the module docstring)."""

    def __init__(self, *, fast_cache: bool = True, crosscheck: int = 0, **kwargs):
        super().__init__(**kwargs)
        if int(crosscheck) < 0:
            raise ValueError(f"crosscheck = {crosscheck}: every Nth first-level hit is checked; use N >= 0")
        self.fast_enabled = fast_cache and _HAS_API and self.shape_env is None
        self.crosscheck = int(crosscheck)  # True -> 1: every hit
        self.fast_hits = 0
        self.fast_misses = 0
        self.fast_checked = 0  # hits dispatched again without a cache and compared
        self._fast: dict = {}
        self._state = _ft._CacheKeyState(None) if _HAS_API else None
        blank = _constructor_state(self) if self.fast_enabled else None
        self._wrap = functools.partial(_fake_tensor, self, blank) if blank is not None else (
            lambda elem, device: FakeTensor(self, elem, device))

    def _fast_key(self, func, args, kwargs) -> tuple:
        key = [func, torch.get_default_dtype(), torch._C._get_default_device(), torch.is_inference_mode_enabled()]
        self._flatten(key, args)
        if kwargs:
            for k, v in kwargs.items():
                key.append(k)
                self._flatten(key, (v,))
        return tuple(key)

    def _flatten(self, key: list, args) -> None:
        add = key.append
        for a in args:
            t = type(a)
            if t in _PLAIN:
                add(t)
                add(a)
            elif isinstance(a, FakeTensor):
                if a.fake_mode is not self or a.constant is not None or a.is_sparse or a.is_mkldnn:
                    raise _NoKey
                add((a.dtype, a.shape, a.stride(), a.storage_offset(),
                     a.requires_grad, a.is_conj(), a.is_neg(), a.is_inference(), a.fake_device))
            elif t is list or t is tuple:
                add(t)
                add(len(a))
                self._flatten(key, a)
            else:  # a real tensor, a SymInt, a function, anything else: torch's path
                raise _NoKey

    def dispatch(self, func, types, args=(), kwargs=None):
        """FakeTensorMode.dispatch less its per-op no_dispatch() context and debug-log call."""
        if (self.fast_enabled and self.cache_enabled and func not in _ft._DISPATCH_META_HANDLERS
                and func not in _ft._DISPATCH_HANDLE_DIRECTLY and not _ft.log.isEnabledFor(logging.DEBUG)):
            return self._cached_dispatch_impl(func, types, args, kwargs or {})
        return super().dispatch(func, types, args, kwargs or {})

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        if not self.fast_enabled:
            return super()._cached_dispatch_impl(func, types, args, kwargs)
        try:
            key = self._fast_key(func, args, kwargs)
        except _NoKey:
            return super()._cached_dispatch_impl(func, types, args, kwargs)
        entry = self._fast.get(key)
        if entry is None:
            self.fast_misses += 1
            return self._fill(key, func, types, args, kwargs)
        if entry is _BYPASS:
            return self._dispatch_impl(func, types, args, kwargs)
        self.fast_hits += 1
        out = self._build(entry, func, args)
        if self.crosscheck and self.fast_hits % self.crosscheck == 0:
            self.fast_checked += 1
            with _ft.disable_fake_tensor_cache(self):
                _check_same(self._dispatch_impl(func, types, args, kwargs), out, func, args)
        return out

    def _build(self, entry, func, args):
        kind, e = entry
        if kind == _INPLACE:
            return args[e]
        if kind == _NEW:  # torch's _get_output_tensor_from_cache_entry for a plain new tensor, less its checks
            return self._wrap(torch.empty_strided(e[0], e[1], dtype=e[2], layout=e[3], device=_META,
                                                  requires_grad=e[4]), e[5])
        if kind == _VIEW:  # the same for a view: its input's storage
            with _ft.in_kernel_invocation_manager(self):
                empty = torch.empty_strided(e[0], e[1], dtype=e[2], layout=e[3], device=_META, requires_grad=e[4])
                empty.set_(args[e[6]].untyped_storage(), e[7], e[0], e[1])
            return self._wrap(empty, e[5])
        if kind == _MULTI:
            return e[0](self._build(x, func, args) for x in e[1])
        return self._output_from_cache_entry(self._state, e, None, func, args)

    def _fill(self, key, func, types, args, kwargs):
        """torch's cached dispatch, and its entry (or its bypass) remembered under the cheap key."""
        try:
            theirs = self._cache_key(_ft._CacheKeyState(self.shape_env), func, args, kwargs)
        except _ft._BypassDispatchCache:
            theirs = None
        out = super()._cached_dispatch_impl(func, types, args, kwargs)
        entry = FakeTensorMode.cache.get(theirs) if theirs is not None else None
        if isinstance(entry, _ft._DispatchCacheValidEntry):
            self._fast[key] = _first_level(entry, func)
        elif func in _ALIASING and not kwargs:
            self._fast[key] = _observed(args, out) or _BYPASS
        elif theirs is None or entry is not None:  # torch does not cache it: nor do we
            self._fast[key] = _BYPASS
        return out


def _first_level(entry, func) -> tuple:
    """(kind, what it needs) for torch's cache entry: see _INPLACE, _NEW, _VIEW, _TORCH."""
    if not entry.is_output_tuple and len(entry.output_infos) == 1:
        info = entry.output_infos[0]
        if info.inplace_idx is not None:
            return _INPLACE, info.inplace_idx
        md = info.metadata
        if md is not None and not md.is_conj and not md.is_neg and all(
                type(v) is int for v in (*md.shape, *md.stride, md.storage_offset)):
            new = (tuple(md.shape), tuple(md.stride), md.dtype, md.layout, md.requires_grad, md.device)
            if not func.is_view:
                return _NEW, new
            if info.view_idx is not None:
                return _VIEW, (*new, info.view_idx, md.storage_offset)
    return _TORCH, entry


def _observed(args, out) -> tuple | None:
    """A first-level entry read off an output: each tensor an argument itself, a view of one argument's
    storage, or a new storage of exactly its own size; None when the output is anything else."""
    if isinstance(out, (list, tuple)) and not isinstance(out, FakeTensor):
        parts = [_observed(args, o) for o in out]
        return None if any(p is None or p[0] == _MULTI for p in parts) else (_MULTI, (type(out), tuple(parts)))
    if not isinstance(out, FakeTensor) or out.is_conj() or out.is_neg() or out.is_sparse:
        return None
    new = (tuple(out.shape), tuple(out.stride()), out.dtype, out.layout, out.requires_grad, out.fake_device)
    st = out.untyped_storage()._cdata
    for i, a in enumerate(args):
        if a is out:
            return _INPLACE, i
        if isinstance(a, FakeTensor) and a.untyped_storage()._cdata == st:
            return _VIEW, (*new, i, out.storage_offset())
    need = sum((n - 1) * s for n, s in zip(out.shape, out.stride())) + 1 if out.numel() else 0
    if out.storage_offset() == 0 and out.untyped_storage().nbytes() == need * out.element_size():
        return _NEW, new
    return None


def _check_same(true, out, func, args) -> None:
    """The crosscheck: `out` (built from the first level) has the metadata of `true` (torch's dispatch without a
    cache), and aliases the same arguments (is one, or shares its storage)."""
    if isinstance(true, (list, tuple)) and not isinstance(true, torch.Tensor):
        if type(true) is not type(out) or len(true) != len(out):
            raise AssertionError(f"{func}: {type(true).__name__} of {len(true)} expected, got {out!r}")
        for t, o in zip(true, out):
            _check_same(t, o, func, args)
        return
    if not isinstance(true, torch.Tensor):
        if true != out:
            raise AssertionError(f"{func}: {true!r} expected, got {out!r}")
        return

    def facts(t):
        st = t.untyped_storage()._cdata
        return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad, t.fake_device,
                t.is_conj(), t.is_neg(), t.untyped_storage().nbytes(), torch._C._dispatch_key_set(t),
                dict(vars(t)),
                tuple((a is t, a.untyped_storage()._cdata == st) for a in args if isinstance(a, FakeTensor)))

    if not isinstance(out, FakeTensor) or facts(true) != facts(out):
        built = facts(out) if isinstance(out, FakeTensor) else out
        raise AssertionError(f"{func}: the first-level cache built {built}, torch's dispatch {facts(true)}")


def _fake_tensor(mode, blank: dict, elem, device):
    """FakeTensor(mode, elem, device) for a meta `elem` and a device read off a FakeTensor (so already
    normalised): FakeTensor.__new__'s argument checks left out, its state (`blank`, less the device) set as it
    sets it."""
    t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                    device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    d = t.__dict__
    d.update(blank)
    d["_fake_device"] = device
    return t


def _constructor_state(mode) -> dict | None:
    """The attributes FakeTensor.__new__ gives a new tensor of `mode`, less its device, if _fake_tensor makes
    with them what torch's constructor makes (the same attributes, values and dispatch keys); else None."""
    try:
        elem = torch.empty(2, 3, device="meta")
        a = FakeTensor(mode, elem, torch.device("cpu"))
        blank = {k: v for k, v in vars(a).items() if k != "_fake_device"}
        b = _fake_tensor(mode, blank, elem, torch.device("cpu"))
        same = (vars(a) == vars(b) and torch._C._dispatch_key_set(a) == torch._C._dispatch_key_set(b)
                and not _ft.FakeTensorConfig.debug)
        return blank if same else None
    except Exception:
        return None
