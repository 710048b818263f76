"""Quantized storages: the save/restore protocol, restore from typed views, bulk allocation,
atomic restore, quantization accuracy and error messages. Runs on CPU; the ``cuda`` variants run
the same checks on a GPU and skip cleanly without one."""

from __future__ import annotations

import pytest
import torch

from offload.engine import marks
from offload import quantized as q
from offload.host.layout import plan_layout_py
from offload.quantized.blockwise import _expand_block_scales

CUDA_OK = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA_OK, reason="needs a CUDA GPU")]
    ),
]

# name -> (builder(x, fp8_dtype, **kw), shape of the test input)
KINDS = {
    "tensorwise": (lambda x, d, **kw: q.quantize_tensorwise(x, d, **kw), (64, 96)),
    "rowwise": (lambda x, d, **kw: q.quantize_blockwise(x, d, block=None, **kw), (64, 96)),
    "block1x128": (lambda x, d, **kw: q.quantize_blockwise(x, d, block=(1, 128), **kw), (128, 256)),
    "block128x128": (
        lambda x, d, **kw: q.quantize_blockwise(x, d, block=(128, 128), **kw),
        (256, 128),
    ),
    "mxfp8": (lambda x, d, **kw: q.quantize_mxfp8(x, d, **kw), (64, 96)),
}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def make_input(shape, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A spread of magnitudes (x^3 of a normal), so blocks and rows get different scales.
    x = torch.randn(shape, generator=g) ** 3 * 2.0
    return x.to(device=device, dtype=dtype)


def make(kind, device, fp8_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16, **kw):
    build, shape = KINDS[kind]
    kw.setdefault("rowwise", True)
    kw.setdefault("columnwise", True)
    return build(make_input(shape, device, dtype), fp8_dtype, **kw)


def usages(s):
    return [u for u, on in (("rowwise", s.rowwise_usage), ("columnwise", s.columnwise_usage)) if on]


def engine_restore(tensors, alignment=256):
    """Simulate the offload engine: copy each tensor's bytes into ONE uint8 buffer at aligned
    offsets and hand back ``buf[off:off + n].view(dtype).as_strided(shape, stride)`` views.

    Like the engine, the whole span a (possibly strided) tensor touches is copied, and the view is
    rebuilt with exactly the saved strides. Returns (views, buffer).
    """
    spans = []
    for t in tensors:
        if t is None:
            spans.append(0)
            continue
        last = (
            t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
            if t.numel()
            else -1
        )
        first = t.storage_offset()
        spans.append((last - first + 1) * t.element_size() if t.numel() else 0)
    offsets, total = plan_layout_py(spans, alignment)
    device = next(t.device for t in tensors if t is not None)
    buf = torch.zeros(total + alignment, dtype=torch.uint8, device=device)
    views = []
    for t, off, n in zip(tensors, offsets, spans):
        if t is None:
            views.append(None)
            continue
        nel = n // t.element_size()
        flat = t.as_strided((nel,), (1,), t.storage_offset())  # the span, from the first element
        buf[off : off + n].copy_(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
        typed = buf[off : off + n].view(t.dtype)
        # as_strided's offset is absolute (elements of t.dtype from the start of the buffer's
        # storage), not relative to the slice: pass the slice's own offset.
        view = typed.as_strided(tuple(t.shape), tuple(t.stride()), typed.storage_offset())
        views.append(view)
    return views, buf


# ---------------------------------------------------------------------------------------------
# protocol round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("as_uint8", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_prepare_restore_roundtrip_bitwise(kind, as_uint8, fp8_dtype, device):
    s = make(kind, device, fp8_dtype, as_uint8=as_uint8)
    names = [n for n, _ in s.named_components()]
    before = {n: t.clone() for n, t in s.named_components()}
    deq = {u: s.dequantize(usage=u) for u in usages(s)}

    tensors, restorable = s.prepare_for_saving()
    assert restorable is s
    assert len(tensors) == len(type(s).component_names())
    # The storage drops its references: autograd's copy must be the only one.
    assert s.components() == [] and s.is_saved
    for n in type(s).component_names():
        assert getattr(s, n) is None

    rest = restorable.restore_from_saved(list(tensors) + ["tail"])
    assert rest == ["tail"]
    assert not s.is_saved
    assert [n for n, _ in s.named_components()] == names
    for n, t in s.named_components():
        assert t is tensors[type(s).component_names().index(n)]
        assert t.dtype == before[n].dtype
        assert torch.equal(t.view(torch.uint8), before[n].view(torch.uint8))
    for u, d in deq.items():
        assert torch.equal(s.dequantize(usage=u), d)


def _expected_dtypes(s):
    """The dtype each component must keep across an offload round trip."""
    data = s.rowwise_data if s.rowwise_data is not None else s.columnwise_data
    exp = {"rowwise_data": data.dtype, "columnwise_data": data.dtype}
    if isinstance(s, q.Float8TensorStorage):
        exp.update(scale_inv=torch.float32, amax=torch.float32)
    elif isinstance(s, q.Float8BlockwiseStorage):
        exp.update(rowwise_scale_inv=torch.float32, columnwise_scale_inv=torch.float32)
    else:
        exp.update(rowwise_scale_inv=torch.uint8, columnwise_scale_inv=torch.uint8)
    return exp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("as_uint8", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_restore_from_typed_views_of_one_uint8_buffer(kind, as_uint8, fp8_dtype, device):
    s = make(kind, device, fp8_dtype, as_uint8=as_uint8)
    deq = {u: s.dequantize(usage=u) for u in usages(s)}
    exp = _expected_dtypes(s)
    data_dtype = torch.uint8 if as_uint8 else fp8_dtype
    assert exp["rowwise_data"] == data_dtype

    tensors, restorable = s.prepare_for_saving()
    views, buf = engine_restore(tensors)
    restorable.restore_from_saved(views)

    for name, t in s.named_components():
        # float32 stays float32, uint8 stays uint8, fp8 stays fp8.
        assert t.dtype == exp[name], name
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
        assert (t.data_ptr() - buf.data_ptr()) % 256 == 0, name
    for u, d in deq.items():
        assert torch.equal(s.dequantize(usage=u), d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_restore_accepts_non_contiguous_views(kind, device):
    """A component may come back as a strided view (e.g. rows with a padded pitch)."""
    s = make(kind, device)
    deq = s.dequantize()
    tensors, restorable = s.prepare_for_saving()
    row = tensors[0]
    m, k = row.shape
    pitch = k + 32
    padded = torch.zeros(m * pitch, dtype=torch.uint8, device=device)
    strided = padded.view(row.dtype).as_strided((m, k), (pitch, 1))
    strided.copy_(row)
    assert not strided.is_contiguous()
    views, _ = engine_restore([strided] + list(tensors[1:]))
    assert views[0].stride() == (pitch, 1)
    restorable.restore_from_saved(views)
    assert torch.equal(s.dequantize(usage="rowwise"), deq)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_bulk_components_share_one_buffer(kind, device):
    s = make(kind, device, bulk=True)
    ref = make(kind, device, bulk=False)
    comps = s.components()
    assert len(comps) >= 3
    base = comps[0].untyped_storage().data_ptr()
    for name, t in s.named_components():
        assert t.untyped_storage().data_ptr() == base, name
        assert (t.data_ptr() - base) % 256 == 0, f"{name} is not 256-byte aligned"
        assert t.is_contiguous(), name
    # Offsets strictly increase: components do not overlap.
    ptrs = [t.data_ptr() for t in comps]
    assert ptrs == sorted(set(ptrs))
    for (n, a), (_, b) in zip(s.named_components(), ref.named_components()):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    # And a bulk storage survives the protocol like any other.
    deq = s.dequantize()
    tensors, r = s.prepare_for_saving()
    r.restore_from_saved(engine_restore(tensors)[0])
    assert torch.equal(s.dequantize(), deq)


# ---------------------------------------------------------------------------------------------
# atomic restore
# ---------------------------------------------------------------------------------------------


def _bad_lists(s, tensors):
    """(description, bad list, the component name the error must mention)."""
    names = type(s).component_names()
    present = [i for i, t in enumerate(tensors) if t is not None]
    absent = [i for i, t in enumerate(tensors) if t is None]
    last = present[-1]
    out = [("too few", list(tensors[:-1]), names[-1])]
    wrong_dtype = list(tensors)
    t = tensors[last]
    wrong_dtype[last] = t.view(torch.uint8) if t.dtype != torch.uint8 else t.view(torch.int8)
    out.append(("dtype", wrong_dtype, names[last]))
    wrong_shape = list(tensors)
    wrong_shape[last] = torch.cat(
        [t.view(torch.uint8).flatten(), t.view(torch.uint8).flatten()]
    ).view(t.dtype)
    out.append(("shape", wrong_shape, names[last]))
    missing = list(tensors)
    missing[last] = None
    out.append(("missing", missing, names[last]))
    if absent:
        extra = list(tensors)
        extra[absent[0]] = tensors[present[0]]
        out.append(("unexpected", extra, names[absent[0]]))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_restore_failure_is_atomic(kind, device):
    s = make(kind, device)
    s.update_usage(columnwise_usage=False)  # leaves absent slots to test "unexpected"
    deq = s.dequantize()
    tensors, r = s.prepare_for_saving()
    for what, bad, name in _bad_lists(s, tensors):
        if what == "too few":
            with pytest.raises(ValueError, match="entries"):
                r.restore_from_saved(bad)
        else:
            with pytest.raises(ValueError, match=f"'{name}'"):
                r.restore_from_saved(bad)
        # Nothing was half-restored.
        assert s.is_saved, what
        for n in type(s).component_names():
            assert getattr(s, n) is None, (what, n)
    r.restore_from_saved(tensors)
    assert torch.equal(s.dequantize(), deq)

    # The same holds for a live storage: a failed restore leaves its components untouched.
    live = s.named_components()
    for what, bad, _ in _bad_lists(s, [getattr(s, n) for n in type(s).component_names()]):
        with pytest.raises(ValueError):
            s.restore_from_saved(bad)
        now = s.named_components()
        assert len(now) == len(live) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(now, live)
        ), what
    assert torch.equal(s.dequantize(), deq)


def test_restore_asserts_each_component_dtype():
    s = q.quantize_tensorwise(make_input((32, 32), "cpu"), columnwise=True)
    tensors, r = s.prepare_for_saving()
    # float32 scale handed back as raw bytes: rejected, naming the component.
    bad = list(tensors)
    bad[2] = tensors[2].view(torch.uint8)
    with pytest.raises(ValueError, match="'scale_inv'.*float32"):
        r.restore_from_saved(bad)
    # fp8 data handed back as uint8: rejected too (it was saved typed).
    bad = list(tensors)
    bad[0] = tensors[0].view(torch.uint8)
    with pytest.raises(ValueError, match="'rowwise_data'"):
        r.restore_from_saved(bad)
    r.restore_from_saved(tensors)

    m = q.quantize_mxfp8(make_input((32, 64), "cpu"), columnwise=True)
    tensors, r = m.prepare_for_saving()
    bad = list(tensors)
    bad[1] = tensors[1].view(torch.int8)
    with pytest.raises(ValueError, match="'rowwise_scale_inv'.*uint8"):
        r.restore_from_saved(bad)
    r.restore_from_saved(tensors)


def test_saved_storage_guards():
    s = q.quantize_tensorwise(make_input((32, 32), "cpu"))
    tensors, r = s.prepare_for_saving()
    with pytest.raises(RuntimeError, match="restore_from_saved"):
        s.prepare_for_saving()
    with pytest.raises(RuntimeError, match="restore_from_saved"):
        s.dequantize()
    r.restore_from_saved(tensors)
    s.release()
    assert s.components() == [] and s.is_saved
    r.restore_from_saved(tensors)
    assert len(s.components()) == 3


# ---------------------------------------------------------------------------------------------
# quantization accuracy and format details
# ---------------------------------------------------------------------------------------------


def _elem_scale(s, usage):
    """Per-element dequantization factor of the (M, K) result, for the error bound."""
    m, k = s.shape
    if isinstance(s, q.Float8TensorStorage):
        return s.scale_inv.reshape(()).expand(m, k)
    if isinstance(s, q.Float8BlockwiseStorage):
        data = getattr(s, f"{usage}_data")
        full = _expand_block_scales(
            getattr(s, f"{usage}_scale_inv"), data.shape[0], data.shape[1], s.block
        )
    else:
        sc = q.e8m0_to_float(getattr(s, f"{usage}_scale_inv"))
        full = sc.repeat_interleave(q.MXFP8_BLOCK_SIZE, dim=1)
    return full if usage == "rowwise" else full.t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("kind", list(KINDS))
def test_quantize_dequantize_error_within_fp8_tolerance(kind, fp8_dtype, dtype, device):
    build, shape = KINDS[kind]
    x = make_input(shape, device, dtype)
    s = build(x, fp8_dtype, rowwise=True, columnwise=True)
    xf = x.float()
    mant = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8_dtype]
    min_sub = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}[fp8_dtype]
    # Round to nearest: half an ulp of the mantissa; MX may also saturate the top binade
    # (e.g. 1.9 * 2^8 -> 448), at most 12.5 %.
    rel = 0.125 if kind == "mxfp8" else 2.0 ** -(mant + 1)
    for usage in ("rowwise", "columnwise"):
        d = s.dequantize(usage=usage)
        assert d.shape == x.shape and d.dtype == torch.float32
        err = (d - xf).abs()
        bound = rel * xf.abs() + 0.5 * min_sub * _elem_scale(s, usage) + 1e-30
        assert bool((err <= bound * (1 + 1e-6)).all()), (usage, float((err - bound).max()))
        normwise = float((d - xf).norm() / xf.norm())
        assert normwise < (0.05 if fp8_dtype == torch.float8_e4m3fn else 0.1), normwise
        assert s.dequantize(dtype, usage=usage).dtype == dtype


def test_tensorwise_scale_and_columnwise_transpose():
    x = make_input((48, 80), "cpu", torch.float32)
    s = q.quantize_tensorwise(x, rowwise=True, columnwise=True)
    amax = x.abs().max()
    assert s.scale_inv.shape == (1,) and s.amax.shape == (1,)
    assert torch.equal(s.amax, amax.reshape(1))
    assert torch.allclose(s.scale_inv, (amax / 448.0).reshape(1))
    # Columnwise data is exactly the transpose of the rowwise data.
    assert s.columnwise_data.is_contiguous()
    assert torch.equal(s.columnwise_data.view(torch.uint8), s.rowwise_data.view(torch.uint8).t())
    assert torch.equal(
        q.fp8_transpose(s.rowwise_data).view(torch.uint8), s.columnwise_data.view(torch.uint8)
    )
    # All-zero input: scale 1, zeros out, no inf/nan.
    z = q.quantize_tensorwise(torch.zeros(16, 16))
    assert float(z.scale_inv) == 1.0 and not z.dequantize().abs().sum()
    # Explicit (delayed) scale.
    d = q.quantize_tensorwise(x, scale=torch.tensor(2.0))
    assert float(d.scale_inv) == 0.5


def test_rowwise_scales_are_per_row_of_each_layout():
    x = make_input((64, 96), "cpu", torch.float32)
    s = q.quantize_blockwise(x, rowwise=True, columnwise=True)
    assert s.rowwise_scale_inv.shape == (64, 1) and s.columnwise_scale_inv.shape == (96, 1)
    assert torch.allclose(s.rowwise_scale_inv, x.abs().amax(1, keepdim=True) / 448.0)
    assert torch.allclose(s.columnwise_scale_inv, x.abs().amax(0).reshape(96, 1) / 448.0)
    assert s.columnwise_data.shape == (96, 64) and s.columnwise_data.is_contiguous()


def test_mxfp8_scale_format():
    # One block per row: amax 1.0 -> floor(log2) = 0 -> shared exp 0 - 8 -> biased 119;
    # amax 448 -> 127; all zeros -> 127 (scale 1).
    x = torch.zeros(3, 32)
    x[0, :] = torch.linspace(-1.0, 1.0, 32)
    x[1, 5] = 448.0
    s = q.quantize_mxfp8(x)
    assert s.rowwise_scale_inv.dtype == torch.uint8 and s.rowwise_scale_inv.shape == (3, 1)
    assert s.rowwise_scale_inv.flatten().tolist() == [119, 127, 127]
    assert torch.equal(s.dequantize()[1], x[1]) and torch.equal(s.dequantize()[2], x[2])
    # Powers of two within the element format's range (2^-9 .. 2^8 relative to the block
    # scale) are exact, whatever the block's magnitude.
    p = torch.tensor(
        [
            [2.0 ** (i % 17 - 9 + 20) for i in range(32)],
            [2.0 ** (i % 17 - 9 - 30) for i in range(32)],
        ]
    )
    assert torch.equal(q.quantize_mxfp8(p).dequantize(), p)
    # E8M0 decode: 2^(e - 127), 255 = NaN.
    dec = q.e8m0_to_float(torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8))
    assert dec[:5].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]
    assert torch.isnan(dec[5])
    # Shapes: (M, K/32) and (K, M/32).
    m = q.quantize_mxfp8(make_input((64, 96), "cpu"), rowwise=True, columnwise=True)
    assert m.rowwise_scale_inv.shape == (64, 3) and m.columnwise_scale_inv.shape == (96, 2)


def test_empty_rows_quantize():
    for s in (
        q.quantize_tensorwise(torch.zeros(0, 32), columnwise=True),
        q.quantize_blockwise(torch.zeros(0, 32), columnwise=True),
        q.quantize_mxfp8(torch.zeros(0, 32), columnwise=True),
    ):
        assert s.dequantize().shape == (0, 32)


def test_update_usage():
    x = make_input((64, 96), "cpu")
    s = q.quantize_tensorwise(x)
    full = q.quantize_tensorwise(x, columnwise=True)
    s.update_usage(columnwise_usage=True)
    assert torch.equal(s.columnwise_data.view(torch.uint8), full.columnwise_data.view(torch.uint8))
    s.update_usage(rowwise_usage=False)
    assert s.rowwise_data is None and not s.rowwise_usage
    tensors, r = s.prepare_for_saving()
    assert tensors[0] is None and tensors[1] is not None
    r.restore_from_saved(tensors)
    with pytest.raises(ValueError, match="both"):
        s.update_usage(columnwise_usage=False)
    b = q.quantize_blockwise(x)
    with pytest.raises(ValueError, match="quantize again"):
        b.update_usage(columnwise_usage=True)
    mx = q.quantize_mxfp8(x, columnwise=True)
    mx.update_usage(rowwise_usage=False)
    assert mx.components()[0].shape == (96, 64)


# ---------------------------------------------------------------------------------------------
# marks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_mark_not_offload_marks_every_component(kind):
    s = make(kind, "cpu")
    comps = s.components()
    marks.mark_not_offload(s)
    assert all(a is b for a, b in zip(s.components(), comps))  # marking does not replace tensors
    for name, t in s.named_components():
        assert marks.is_marked_keep(t), name
    # The marks travel with what autograd saves.
    tensors, r = s.prepare_for_saving()
    assert all(marks.is_marked_keep(t) for t in tensors if t is not None)
    r.restore_from_saved(tensors)

    s2 = make(kind, "cpu")
    marks.mark_activation_offload(s2)
    assert all(marks.is_marked_offload(t) for t in s2.components())
    assert not any(marks.is_marked_keep(t) for t in s2.components())


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_clear_errors_on_bad_input():
    x = make_input((64, 96), "cpu")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        q.quantize_tensorwise(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="2-D"):
        q.quantize_tensorwise(torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="2-D"):
        q.quantize_mxfp8(torch.ones(64))
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        q.quantize_tensorwise(x, torch.float16)
    if hasattr(torch, "float8_e4m3fnuz"):
        with pytest.raises(ValueError, match="fp8_dtype"):
            q.quantize_blockwise(x, torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="at least one"):
        q.quantize_tensorwise(x, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="K=40 .*multiple of 32"):
        q.quantize_mxfp8(torch.ones(64, 40))
    with pytest.raises(ValueError, match="M=48 .*multiple of 32"):
        q.quantize_mxfp8(torch.ones(48, 64), columnwise=True)
    with pytest.raises(ValueError, match="1x128 blocks"):
        q.quantize_blockwise(x, block=(1, 128))
    with pytest.raises(ValueError, match="block must be"):
        q.quantize_blockwise(x, block=(2, 64))
    with pytest.raises(ValueError, match="'scale_inv' must be torch.float32"):
        q.Float8TensorStorage(
            rowwise_data=torch.zeros(4, 4, dtype=torch.uint8),
            columnwise_data=None,
            scale_inv=torch.ones(1, dtype=torch.float64),
        )
    with pytest.raises(ValueError, match="'columnwise_data' must have shape"):
        q.Float8TensorStorage(
            rowwise_data=torch.zeros(4, 8, dtype=torch.uint8),
            columnwise_data=torch.zeros(4, 8, dtype=torch.uint8),
            scale_inv=torch.ones(1),
        )
    with pytest.raises(ValueError, match="'rowwise_data' must be"):
        q.MXFP8TensorStorage(
            rowwise_data=torch.zeros(4, 32, dtype=torch.float16),
            rowwise_scale_inv=torch.zeros(4, 1, dtype=torch.uint8),
            columnwise_data=None,
            columnwise_scale_inv=None,
        )
    with pytest.raises(ValueError, match="QuantizedStorage"):
        q.dequantize(torch.ones(2, 2))
