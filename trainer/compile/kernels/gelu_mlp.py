"""Matmuls with the MLP's GELU in their epilogue (``model.mlp: triton``).

GPT-2's MLP is ``y = c_proj(gelu_tanh(c_fc(x)))``. Compiled by Inductor on gpt2-small (H100, B=16,
T=1024), the (tokens x 4C) tensors around the GELU are each written by a cuBLAS matmul and read
again by a Triton kernel: forward, ``h = x @ W1.T + b1`` is written, then read to write
``g = gelu(h)``; backward, ``dg = dy @ W2`` is written, then read with ``h`` to write
``dh = dg * gelu'(h)`` and ``g`` (recomputed for ``dW2``), and read again for the bias gradient.

Here the GELU runs on the matmul's fp32 accumulator, tile by tile, before anything is stored:

- forward (``EPILOGUE_GELU``): ``x @ W1.T + b1`` stores ``h`` (kept for the backward) and ``g``;
- backward (``EPILOGUE_DGELU``): ``dy @ W2`` never stores ``dg``; it loads the ``h`` tile and stores
  ``dh = dg * gelu'(h)``, ``g = gelu(h)`` and per-tile column sums of ``dh`` (the bias gradient's
  partial sums, finished by a small ``sum(0)``).

The matmul is Triton's (``tl.dot``: wgmma on Hopper), tiled with grouped ordering for L2 reuse.
Numerics: fp32 accumulation, GELU and its derivative in fp32 on the accumulator (the unfused chain
rounds ``h`` and ``dg`` to bf16 first), outputs rounded to nearest.

Triton runs on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before ``triton``
was first imported; otherwise CPU tensors take the same math in PyTorch ops.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from trainer.compile.kernels.flat import interpreted, triton_can_run

EPILOGUE_NONE = 0
EPILOGUE_GELU = 1
EPILOGUE_DGELU = 2

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715

# Tile: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages), per epilogue. Chosen on an H100
# (scripts/bench_gelu_mlp.py sweeps them).
TILES = {
    EPILOGUE_NONE: (128, 256, 64, 8, 8, 3),
    EPILOGUE_GELU: (128, 256, 64, 8, 8, 3),
    EPILOGUE_DGELU: (128, 128, 64, 8, 8, 4),
}
_INTERPRETER_TILE = (32, 32, 32, 4, 4, 1)


@triton.jit
def _tanh(u):
    # 1 - 2 / (e^{2u} + 1): exact limits at both ends (e^{2u} -> inf gives 1, -> 0 gives -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _mm_gelu_kernel(
    A,
    B,
    BIAS,
    H,
    OUT,
    G,
    DB_PART,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of ``acc = A @ B`` (A (M, K), B (K, N), any strides), then:

    - EPILOGUE_NONE: OUT = acc (+ bias);
    - EPILOGUE_GELU: OUT = acc + bias (h), G = gelu(h);
    - EPILOGUE_DGELU: with h read from H, OUT = acc * gelu'(h) (dh), G = gelu(h) when WRITE_G, and
      DB_PART[pid_m] = the tile's column sums of dh when HAS_BIAS.

    OUT, G and H are contiguous (M, N).
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles sweep the columns together, so B's tiles stay in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read the last valid ones (their results are never stored), so
    # the main loop's loads need masks only along K.
    ram = tl.minimum(rm, M - 1).to(tl.int64)
    rbn = tl.minimum(rn, N - 1).to(tl.int64)
    a_ptrs = A + ram[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rbn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong; fp32 inputs give the fp32-accumulated result
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if EPILOGUE == 2:
        h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rbn).to(tl.float32)[None, :]
        h = acc
    if EPILOGUE == 0:
        tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        if EPILOGUE == 1:
            h = h.to(OUT.dtype.element_ty)  # h is stored rounded; g is the GELU of what is stored
            tl.store(OUT + offs, h, mask=mask)
            h = h.to(tl.float32)
        t = _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
        if EPILOGUE == 1 or WRITE_G:
            tl.store(G + offs, (0.5 * h * (1.0 + t)).to(G.dtype.element_ty), mask=mask)
        if EPILOGUE == 2:
            d_gelu = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
            dh = acc * d_gelu
            tl.store(OUT + offs, dh.to(OUT.dtype.element_ty), mask=mask)
            if HAS_BIAS:
                part = tl.sum(tl.where(mask, dh, 0.0), axis=0)
                tl.store(DB_PART + pid_m.to(tl.int64) * N + rn, part, mask=rn < N)


_INTERPRETED = interpreted(_mm_gelu_kernel)


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernel can run on tensors of ``device`` in this process."""
    return triton_can_run(device, _mm_gelu_kernel)


def gelu_tanh(h: Tensor) -> Tensor:
    """GELU, tanh approximation, in fp32 (what ``F.gelu(h, approximate="tanh")`` computes)."""
    h = h.float()
    return 0.5 * h * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (h + _KAPPA * h * h * h)))


def gelu_tanh_grad(h: Tensor) -> Tensor:
    """d gelu_tanh / dh in fp32."""
    h = h.float()
    t = torch.tanh(_SQRT_2_OVER_PI * (h + _KAPPA * h * h * h))
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _KAPPA * h * h)


def mm_gelu(
    a: Tensor,
    b: Tensor,
    epilogue: int,
    *,
    bias: Tensor | None = None,
    h: Tensor | None = None,
    write_g: bool = True,
    tile: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``a @ b`` (``a`` (M, K), ``b`` (K, N), same dtype, any strides) with an epilogue; see the kernel.

    Returns ``(out, g, db)``: EPILOGUE_NONE ``(a @ b + bias, None, None)``; EPILOGUE_GELU
    ``(h, gelu(h), None)`` with ``h = a @ b + bias``; EPILOGUE_DGELU ``(dh, g, db)`` with ``dh = (a @ b) *
    gelu'(h)``, ``g = gelu(h)`` (None without ``write_g``) and ``db = dh.sum(0)`` in fp32 (None without
    ``bias``, which is then only a flag). Outputs are contiguous, in ``a``'s dtype.
    """
    M, K = a.shape
    N = b.shape[1]
    assert b.shape[0] == K and a.dtype == b.dtype
    if epilogue == EPILOGUE_DGELU:
        assert h is not None and h.shape == (M, N) and h.is_contiguous()
    out = a.new_empty((M, N))
    g = a.new_empty((M, N)) if epilogue == EPILOGUE_GELU or (epilogue == EPILOGUE_DGELU and write_g) else None
    if not use_triton(a.device):
        return _mm_gelu_torch(a, b, epilogue, bias, h, out, g)
    BM, BN, BK, GM, warps, stages = tile or (_INTERPRETER_TILE if _INTERPRETED else TILES[epilogue])
    grid_m = triton.cdiv(M, BM)
    has_bias = bias is not None
    db_part = a.new_empty((grid_m, N), dtype=torch.float32) if epilogue == EPILOGUE_DGELU and has_bias else None
    _mm_gelu_kernel[(grid_m * triton.cdiv(N, BN),)](
        a,
        b,
        bias if has_bias and epilogue != EPILOGUE_DGELU else out,
        h if epilogue == EPILOGUE_DGELU else out,
        out,
        g if g is not None else out,
        db_part if db_part is not None else out,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        EPILOGUE=epilogue,
        HAS_BIAS=has_bias,
        WRITE_G=g is not None,
        BLOCK_M=BM,
        BLOCK_N=BN,
        BLOCK_K=BK,
        GROUP_M=GM,
        EVEN_K=K % BK == 0,
        DOT_FP32=_INTERPRETED,
        num_warps=warps,
        num_stages=stages,
    )
    db = db_part.sum(0) if db_part is not None else None
    return out, g, db


def _mm_gelu_torch(a, b, epilogue, bias, h, out, g):
    """The kernel's contract in PyTorch ops (fp32 accumulation), for CPU tensors without the interpreter."""
    acc = a.float() @ b.float()
    if epilogue != EPILOGUE_DGELU and bias is not None:
        acc += bias.float()
    if epilogue == EPILOGUE_NONE:
        out.copy_(acc)
        return out, None, None
    if epilogue == EPILOGUE_GELU:
        out.copy_(acc)
        g.copy_(gelu_tanh(out))
        return out, g, None
    dh = acc * gelu_tanh_grad(h)
    out.copy_(dh)
    if g is not None:
        g.copy_(gelu_tanh(h))
    return out, g, (dh.sum(0) if bias is not None else None)
