"""cuBLASLt matmuls with a GELU epilogue, called through ctypes (CUDA only).

PyTorch calls cuBLASLt for its matmuls but exposes only the bias and plain GELU epilogues
(``torch._addmm_activation``). cuBLASLt also has the two a training MLP needs:

- ``GELU_AUX_BIAS``: ``g = gelu(a @ b + bias)`` and, as the auxiliary output, the pre-activation
  ``h = a @ b + bias`` (kept for the backward);
- ``DGELU_BGRAD``: ``dh = (a @ b) * gelu'(h)`` with ``h`` read as the auxiliary input, and the bias
  gradient ``dh.sum(0)``.

Both run on the accumulator in cuBLAS's own kernels, so the (tokens x 4C) tensors around the GELU
are not written by one kernel and read by the next. cuBLASLt's GELU is the tanh approximation
(GPT-2's ``nn.GELU(approximate="tanh")``). Row-major torch tensors are passed as their column-major
transposes: ``C = A @ B`` is computed as ``C.T = B.T @ A.T``.

Enum values and struct layouts are cuBLASLt's (``cublasLt.h``), stable across CUDA 11-13.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os

import torch
from torch import Tensor

# cublasLt.h / library_types.h
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE = 1
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4
EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4
EPILOGUE_DGELU = 64 | 128
EPILOGUE_DGELU_BGRAD = EPILOGUE_DGELU | 16
_DTYPES = {torch.float32: _CUDA_R_32F, torch.float16: _CUDA_R_16F, torch.bfloat16: _CUDA_R_16BF}
_WORKSPACE_BYTES = 32 * 2**20


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


@functools.cache
def _lib() -> ctypes.CDLL:
    names = ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so"]
    # torch's CUDA wheels ship it under site-packages/nvidia/*/lib; the process usually has it loaded already.
    site = os.path.dirname(os.path.dirname(torch.__file__))
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*")))
    names += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcublasLt.so*")))
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_size_t, ctypes.c_void_p]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [ctypes.c_void_p] * 7 + [
            ctypes.c_int,
            ctypes.POINTER(_HeuristicResult),
            ctypes.POINTER(ctypes.c_int),
        ]
        lib.cublasLtMatrixLayoutCreate.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        for fn in ("cublasLtMatmulDescSetAttribute", "cublasLtMatmulPreferenceSetAttribute"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    raise CublasLtError(f"libcublasLt not found: {'; '.join(errors)}")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus_t {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


@functools.cache
def _workspace(device: torch.device) -> Tensor:
    return torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _set(setter, desc, attr: int, value) -> None:
    _check(setter(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), f"set attribute {attr}")


class _Plan:
    """Descriptors and the heuristic's algorithm for one problem (shapes, dtypes, epilogue); pointers set per call."""

    def __init__(self, m: int, n: int, k: int, trans_a: bool, trans_b: bool, lda: int, ldb: int, dtype, epilogue):
        lib = _lib()
        dt = _DTYPES[dtype]
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "desc")
        s = lib.cublasLtMatmulDescSetAttribute
        _set(s, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T if trans_a else _OP_N))
        _set(s, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_T if trans_b else _OP_N))
        _set(s, self.desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if epilogue in (EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU, EPILOGUE_DGELU_BGRAD):
            _set(s, self.desc, _DESC_AUX_LD, ctypes.c_int64(m))
        # Column-major: D (m, n) = op(A) @ op(B), op(A) (m, k), op(B) (k, n).
        self.a_layout, self.b_layout, self.d_layout = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        create = lib.cublasLtMatrixLayoutCreate
        _check(create(ctypes.byref(self.a_layout), dt, a_rows, a_cols, lda), "layout A")
        _check(create(ctypes.byref(self.b_layout), dt, b_rows, b_cols, ldb), "layout B")
        _check(create(ctypes.byref(self.d_layout), dt, m, n, m), "layout D")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE, ctypes.c_uint64(_WORKSPACE_BYTES))
        self.result = _HeuristicResult()
        count = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(
            _handle(),
            self.desc,
            self.a_layout,
            self.b_layout,
            self.d_layout,
            self.d_layout,
            pref,
            1,
            ctypes.byref(self.result),
            ctypes.byref(count),
        )
        lib.cublasLtMatmulPreferenceDestroy(pref)
        _check(status, "cublasLtMatmulAlgoGetHeuristic")
        if count.value == 0:
            raise CublasLtError(f"no cuBLASLt algorithm for epilogue {epilogue} at m={m} n={n} k={k}")

    def run(self, a: Tensor, b: Tensor, d: Tensor, bias: Tensor | None, aux: Tensor | None) -> None:
        lib = _lib()
        s = lib.cublasLtMatmulDescSetAttribute
        if bias is not None:
            _set(s, self.desc, _DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        if aux is not None:
            _set(s, self.desc, _DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        ws = _workspace(d.device)
        _check(
            lib.cublasLtMatmul(
                _handle(),
                self.desc,
                ctypes.byref(one),
                ctypes.c_void_p(a.data_ptr()),
                self.a_layout,
                ctypes.c_void_p(b.data_ptr()),
                self.b_layout,
                ctypes.byref(zero),
                ctypes.c_void_p(d.data_ptr()),
                self.d_layout,
                ctypes.c_void_p(d.data_ptr()),
                self.d_layout,
                ctypes.byref(self.result, 0),  # the algo is the struct's first field
                ctypes.c_void_p(ws.data_ptr()),
                _WORKSPACE_BYTES,
                ctypes.c_void_p(torch.cuda.current_stream(d.device).cuda_stream),
            ),
            "cublasLtMatmul",
        )


@functools.cache
def _plan(*key) -> _Plan:
    return _Plan(*key)


def _row_major_operand(t: Tensor) -> tuple[bool, int]:
    """How a row-major 2-D ``t`` reads as a column-major cuBLAS operand of ``t.T``: (transposed, ld)."""
    if t.stride(1) == 1:
        return False, t.stride(0)  # t.T column-major, not transposed
    if t.stride(0) == 1:
        return True, t.stride(1)
    raise ValueError(f"cuBLASLt needs a unit stride in one dimension, got strides {t.stride()}")


def matmul(a: Tensor, b: Tensor, epilogue: int = EPILOGUE_DEFAULT, *, bias=None, aux=None, out=None) -> Tensor:
    """``a @ b`` for row-major (M, K) and (K, N) CUDA tensors of one dtype, with a cuBLASLt epilogue.

    - EPILOGUE_GELU_AUX_BIAS: returns ``gelu(a @ b + bias)``; ``aux`` (M, N) receives ``a @ b + bias``.
    - EPILOGUE_DGELU_BGRAD: returns ``(a @ b) * gelu'(aux)``; ``bias`` (N,) receives its column sums.
    """
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K or a.dtype != b.dtype or a.device.type != "cuda":
        raise ValueError(f"expected CUDA (M, K) @ (K, N) of one dtype, got {a.shape} {b.shape} {a.dtype} {b.dtype}")
    out = a.new_empty((M, N)) if out is None else out
    # Column-major: out.T (N, M) = b.T (N, K) @ a.T (K, M).
    tb, ldb = _row_major_operand(b)  # b.T as cuBLAS's A
    ta, lda = _row_major_operand(a)  # a.T as cuBLAS's B
    plan = _plan(N, M, K, tb, ta, ldb, lda, a.dtype, epilogue)
    plan.run(b, a, out, bias, aux)
    return out
