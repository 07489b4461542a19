"""Our Triton optimizers, and the compiled one, on FSDP2's DTensor shards: 2 gloo ranks against one process.

Under fsdp each rank's TritonAdamW/TritonSGD updates its local shards where FSDP keeps them (an address table for
the parameters as for the gradients), with its states in flat buffers sized to the shards, shown as DTensors;
the clipping norm's sum of squares is all-reduced over the ranks (trainer/optim/flat.py). The Triton
kernels run under TRITON_INTERPRET=1 on CPU (tests/conftest.py sets it before triton is imported).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import GPU_CACHE, ROOT, cli, losses, metric, shared_run, start_torchrun, torchrun
from tests.test_distributed import SHAPE, _env, _fit_cmd, _params, _torchrun, _worker_env
from tests.test_optim_kernels import DEVICE
from tests.test_optim_kernels import _params as _tensors
from trainer.optim.optimizers import TritonSGD

# optim.grad_clip=0.5 clips every step here (the norms are 1.7 to 2.7; checked below); a checkpoint at step 5
# is what the 1-process resume starts from.
COMMON = [*SHAPE, "train.steps=8", "log.every=1", "optim.impl=triton", "optim.grad_clip=0.5", "checkpoint.every=5"]
OPTIMIZERS = {"adamw": ["optim.lr=3e-3"], "sgd": ["optim.name=sgd", "optim.lr=0.1"]}
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def _run(nproc: int, run_dir, *args, capsys=None) -> None:
    """``trainer fit`` on 2 ranks under torchrun, or in one process: this one (``capsys`` reads its output)."""
    if nproc == 1:
        r = cli(capsys, "fit", "configs/tiny.yaml", *COMMON, *args, f"run.dir={run_dir}")
    else:
        r = _torchrun(nproc, *COMMON, *args, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, nproc)``: the run dir of 8 steps of optimizer ``name`` in one process (a test process; the
    reference, the whole global batch of 8 sequences) or on 2 fsdp ranks (4 each); each run once per session."""

    def make(name: str, nproc: int, run_dir):
        if nproc == 1:
            _run(1, run_dir, *OPTIMIZERS[name], "train.micro_batch_size=8")
        else:
            _run(2, run_dir, *OPTIMIZERS[name], "train.micro_batch_size=4", "distributed.strategy=fsdp")

    def get(name: str, nproc: int):
        return shared_run(tmp_path_factory, f"fsdp_optim-{name}-{nproc}", lambda d: make(name, nproc, d))

    return get


def _optim_states(run_dir, step: int) -> list[dict]:
    """The optimizer's per-parameter state at ``step``, whole tensors in parameter order: from optim.pt, or from an
    fsdp run's DCP checkpoint (keyed by name there; the param groups give the order)."""
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:  # not in the run's directory: it may be another test's too
            dcp_to_torch_save(ckpt / "dcp", Path(tmp) / "whole_optim.pt")
            sd = torch.load(Path(tmp) / "whole_optim.pt", weights_only=False)["optim"]
    else:
        sd = torch.load(ckpt / "optim.pt", weights_only=True)["optimizer"]
    return [sd["state"][k] for g in sd["param_groups"] for k in g["params"]]


def _assert_states_close(name: str, a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for sa, sb in zip(a, b):
        for key in STATE_KEYS[name]:
            assert sa[key].shape == sb[key].shape  # whole tensors: every rank's shard was saved
            # Adam's second moment is ~g^2 (orders of magnitude apart): relative to each tensor's largest entry.
            # Observed 7.1e-7 (adamw, both moments), 3.8e-7 (sgd): the ranks' gradients summed in another order.
            scale = sb[key].abs().max().clamp_min(1e-30)
            err = ((sa[key] - sb[key]).abs().max() / scale).item()
            assert err < 1e-5, (key, err)
        if "step" in sb:
            assert float(sa["step"]) == float(sb["step"])


@pytest.mark.slow  # ~8 s alone on 2 cores (10-20 s in the suite): a 2-rank run of trainer fit, the reference
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fsdp_triton_reproduces_one_process(name, runs):
    """fsdp + optim.impl=triton (clipping every step) on 2 ranks = one process with the same global batch: losses,
    the logged global gradient norm (all-reduced over the shards), parameters and optimizer states.

    SGD is the case that checks the clip coefficient (Adam's update hardly depends on a gradient scale): without the
    norm's all-reduce, the sgd losses differ by 1.2e-2 at step 2."""
    one, two = runs(name, 1), runs(name, 2)
    assert (two / "checkpoints" / "step_000008" / "dcp").is_dir()
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    # The ranks' gradients are reduced in another order than one process's batched matmuls: observed max |diff|
    # 7.2e-7 (adamw), 1.2e-6 (sgd) over 8 steps, as with torch's optimizers under fsdp.
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    na, nb = metric(one, "grad_norm"), metric(two, "grad_norm")
    assert min(na.values()) > 0.5  # optim.grad_clip=0.5: every step clips (observed norms 1.6 to 2.6)
    for step in na:
        # One norm over whole gradients against sqrt(all_reduce(sum of squares over shards)): observed 1.5e-7.
        assert abs(na[step] - nb[step]) <= 1e-5 * na[step], (step, na[step], nb[step])
    pa, pb = _params(one, 8), _params(two, 8)
    assert set(pa) == set(pb)
    for k in pa:
        # Observed 4.8e-7 (adamw: the update divides by sqrt(v), which magnifies the gradients' rounding where they
        # are small), 1.2e-7 (sgd).
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)
    _assert_states_close(name, _optim_states(two, 8), _optim_states(one, 8))


@pytest.mark.slow  # the 2-rank run (shared with the test above in one test process), the reference, the resume
def test_save_on_two_ranks_resume_on_one(runs, tmp_path, capsys):
    """The 2-rank fsdp run's DCP checkpoint of step 5 (states saved as DTensors: every rank's shards), resumed in
    one process (this one) to step 8: the same losses, parameters and optimizer states as one uninterrupted process."""
    one, two = runs("adamw", 1), runs("adamw", 2)
    ckpt = two / "checkpoints" / "step_000005"
    assert (ckpt / "dcp").is_dir() and not (ckpt / "model.pt").exists()
    r = _run(1, tmp_path, *OPTIMIZERS["adamw"], "train.micro_batch_size=8", f"resume={ckpt}", capsys=capsys)
    assert "resumed from" in r.stdout
    a, b = losses(one), losses(tmp_path)
    assert sorted(b) == [6, 7, 8]
    for step in b:  # observed 4.8e-7, as without the resume
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])
    pa, pb = _params(one, 8), _params(tmp_path, 8)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 4.7e-7
    # Lost moments would show here first: Adam's second moment restarts from zero.
    _assert_states_close("adamw", _optim_states(tmp_path, 8), _optim_states(one, 8))


@pytest.mark.slow  # ~14 s alone on 2 cores (~21 s in the suite): Inductor compiles the step here and on 2 ranks
def test_fsdp_compiled_optimizer_reproduces_one_process(tmp_path):
    """optim.impl=compiled (Inductor, foreach AdamW with capturable tensors) steps FSDP2's DTensor parameters and
    states: the same losses and parameters as one process (that it stays compiled is checked by the worker test).

    One block without biases (8 parameters): compiling the step over DTensors takes each rank seconds per parameter
    on the CPU (33 CPU-s for the 2-rank run with 2 blocks and biases, 28 parameters; 18 CPU-s with 8)."""
    args = ["optim.impl=compiled", "optim.lr=3e-3", "model.n_layer=1", "model.bias=false"]
    _run(1, tmp_path / "one", *args, "train.micro_batch_size=8")
    _run(2, tmp_path / "two", *args, "train.micro_batch_size=4", "distributed.strategy=fsdp")
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert abs(a[step] - b[step]) < 1e-5, (step, a[step], b[step])  # observed 7.2e-7
    pa, pb = _params(tmp_path / "one", 8), _params(tmp_path / "two", 8)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=1e-5)  # observed 5.4e-7


# 2 gloo ranks: a model whose shards are uneven (67 rows over 2 ranks: 34 and 33; a bias of 1: one rank holds an
# empty shard) and longer than a kernel block (34 x 64 = 2176 > 2048 elements), fully_shard per layer and root.
# Each rank also trains an unsharded copy on the whole batch with the same optimizer: the reference.
_WORKER = r"""
import copy, json, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

dist.init_process_group("gloo")
rank = dist.get_rank()
from trainer.optim.optimizers import TritonAdamW, TritonSGD
from trainer.optim.compiled import compile_optimizer

def model(sharded):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 67), nn.Tanh(), nn.Linear(67, 1))
    if sharded:
        fully_shard(m[0])
        fully_shard(m[2])
        fully_shard(m)
    return m

gen = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 64, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(4)]

def train(m, opt):
    norms = []
    for x, y in batches:
        if isinstance(m[0].weight, DTensor):
            x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
        ((m(x) - y) ** 2).mean().backward()
        opt.step()
        norms.append(float(opt.last_grad_norm) if getattr(opt, "last_grad_norm", None) is not None else 0.0)
        opt.zero_grad()
    return norms

def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t

def max_diff(a, b):
    return max((full(x) - full(y)).abs().max().item() for x, y in zip(a, b))

out = {}
cases = {
    "adamw": lambda ps: TritonAdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5),
    "sgd": lambda ps: TritonSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, max_grad_norm=0.5),
}
for name, make in cases.items():
    ref, sharded = model(False), model(True)
    ref_opt, opt = make(list(ref.parameters())), make(list(sharded.parameters()))
    storage = [p._local_tensor.data_ptr() for p in sharded.parameters()]
    ref_norms, norms = train(ref, ref_opt), train(sharded, opt)
    key = "momentum_buffer" if name == "sgd" else "exp_avg_sq"
    states = [opt.state[p][key] for p in sharded.parameters()]
    out[name] = {
        "param_err": max_diff(ref.parameters(), sharded.parameters()),
        "norm_err": max(abs(a - b) / a for a, b in zip(ref_norms, norms)),
        "clipped": min(ref_norms) > 0.5,
        "in_place": storage == [p._local_tensor.data_ptr() for p in sharded.parameters()],
        "empty_shard": any(p._local_tensor.numel() == 0 for p in sharded.parameters()),
        "states_dtensor": all(isinstance(s, DTensor) and s.placements == p.placements and s.shape == p.shape
                              for s, p in zip(states, sharded.parameters())),
        "state_err": max_diff([ref_opt.state[p][key] for p in ref.parameters()], states),
    }
    # torch's optimizer loads our state dict (DTensor states) and takes the same next step as ours.
    theirs = model(True)
    for p, q in zip(theirs.parameters(), sharded.parameters()):
        p.data.copy_(q.data)
    torch_opt = (torch.optim.AdamW(list(theirs.parameters())) if name == "adamw" else
                 torch.optim.SGD(list(theirs.parameters()), lr=0.05, momentum=0.9, nesterov=True))
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its states are live views, like torch's
    x, y = batches[0][0][rank * 4 : rank * 4 + 4], batches[0][1][rank * 4 : rank * 4 + 4]
    for m, o in ((sharded, opt), (theirs, torch_opt)):
        ((m(x) - y) ** 2).mean().backward()
        if o is torch_opt:
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.5)
        o.step()
    out[name]["torch_next_step_err"] = max_diff(theirs.parameters(), sharded.parameters())

# The refusals: flat gradient buffers cannot hold FSDP's gradients; plain tensors next to DTensors.
for label, make in {"flat": lambda: TritonAdamW(list(model(True).parameters()), flat_grads=True),
                    "mixed": lambda: TritonAdamW([*model(True).parameters(), nn.Parameter(torch.zeros(3))])}.items():
    try:
        make()
        out["refused_" + label] = None
    except ValueError as e:
        out["refused_" + label] = str(e)

# compile_optimizer (Dynamo + aot_eager here; the fit test runs Inductor) over DTensor params and states: it stays
# compiled (no fallback to eager) and steps as the eager foreach AdamW does.
eager, compiled = model(True), model(True)
kw = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
eager_opt = torch.optim.AdamW(list(eager.parameters()), **kw)
compiled_opt = compile_optimizer(torch.optim.AdamW(list(compiled.parameters()), **kw), backend="aot_eager")
train(eager, eager_opt)
train(compiled, compiled_opt)
out["compiled"] = {"still_compiled": compiled_opt.compiled,
                   "param_err": max_diff(eager.parameters(), compiled.parameters())}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(out, f)
sys.stdout.flush()
os._exit(0)  # not finalizing the interpreter, where gloo's threads can abort it (trainer.distributed.env.exit_code)
"""


@pytest.mark.slow  # ~9 s alone on 2 cores: Triton's interpreter and Dynamo on 2 ranks
def test_sharded_optimizers_in_a_worker(tmp_path):
    """2 gloo ranks: TritonAdamW and TritonSGD (Nesterov, clipping) on FSDP2 DTensor shards equal the same optimizer
    on whole tensors, write FSDP's own storage, hold DTensor states that torch's optimizer loads; the refusals;
    compile_optimizer on DTensors stays compiled."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path)]  # fmt: skip
    r = torchrun(cmd, timeout=300, env=_worker_env())
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert any(res["adamw"]["empty_shard"] for res in results)  # the case where one rank has nothing to update
    for res in results:
        for name in ("adamw", "sgd"):
            v = res[name]
            # in_place: each local shard still where FSDP put it (its all-gathers read from there, so the parameters
            # matching the reference also says the updates landed there).
            assert v["clipped"] and v["in_place"] and v["states_dtensor"], (name, v)
            # fp32; the ranks' gradients are reduced in another order than one process's matmul: observed 3.7e-8
            # (params), 1.0e-7 (norms, relative), 3.4e-8 (states).
            assert v["param_err"] < 1e-6 and v["norm_err"] < 1e-6 and v["state_err"] < 1e-6, (name, v)
            # torch's optimizer continuing from a deep copy of our state dict (DTensor states deep-copy, see
            # flat.py): torch's arithmetic and clip against ours, one step (observed 1.5e-8 adamw, 7.5e-9 sgd).
            assert v["torch_next_step_err"] < 1e-6, (name, v)
        assert "flat_grads=True" in res["refused_flat"] and "leave flat_grads unset" in res["refused_flat"]
        assert "next to plain tensors" in res["refused_mixed"]
        assert res["compiled"]["still_compiled"]
        assert res["compiled"]["param_err"] < 1e-6, res["compiled"]  # observed 3e-8: traced foreach, fp32


SGD_CASES = {
    "plain": dict(momentum=0.0),
    "momentum": dict(momentum=0.9, weight_decay=0.01),
    "nesterov": dict(momentum=0.9, nesterov=True, dampening=0.0),
}


@pytest.mark.parametrize("kw", list(SGD_CASES.values()), ids=list(SGD_CASES))
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_sgd_table_mode_equals_flat_mode(kw, max_norm):
    """TritonSGD(flat_grads=False) (the kernel fsdp runs, with the parameters in a flat buffer here) against the
    flat-buffer kernel and torch's SGD: the same update arithmetic, a None gradient counted as zero."""
    shapes = [(5, 3), (7,), (2049,)]
    flat_ps, table_ps, torch_ps = _tensors(shapes), _tensors(shapes), _tensors(shapes)
    flat = TritonSGD(flat_ps, lr=0.1, max_grad_norm=max_norm, **kw)
    table = TritonSGD(table_ps, lr=0.1, max_grad_norm=max_norm, flat_grads=False, **kw)
    theirs = torch.optim.SGD(torch_ps, lr=0.1, foreach=False, **kw)
    gen = torch.Generator().manual_seed(3)
    for k in range(4):
        grads = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
        for p, q, t, g in zip(flat_ps, table_ps, torch_ps, grads):
            p.grad, q.grad, t.grad = g.clone(), g.clone(), g.clone()
        if k == 2:
            flat_ps[1].grad, table_ps[1].grad, torch_ps[1].grad = None, None, torch.zeros(shapes[1], device=DEVICE)
        if max_norm:
            torch.nn.utils.clip_grad_norm_(torch_ps, max_norm)
        for opt in (flat, table, theirs):
            opt.step()
            opt.zero_grad()
        for p, q, t in zip(flat_ps, table_ps, torch_ps):
            # Without clipping: the same arithmetic, bit for bit. With it: the norms' partial sums group differently
            # (1 ulp of the coefficient), and torch clips the gradient before the update: observed 6e-8.
            tol = dict(rtol=0, atol=0) if not max_norm else dict(rtol=0, atol=1e-6)
            torch.testing.assert_close(q, p, **tol)
            torch.testing.assert_close(q, t, rtol=0, atol=1e-6)  # torch's SGD in its own order: observed 6e-8
    assert all(q.grad is None for q in table_ps)  # zero_grad sets them to None, as torch's does


def test_the_table_reaches_a_wrapper_subclass_values_and_refuses_one_without_storage():
    """A wrapper subclass reports ``data_ptr() == 0``. With one inner tensor of its shape and dtype (torchao's float8
    weight, beside its precomputed scale) the table takes that tensor's address; with two (torch's ``TwoTensor``) it
    cannot tell where the values live and says so, instead of handing the kernel address 0."""
    from torch.testing._internal.two_tensor import TwoTensor

    from trainer.optim.grad_table import GradTable, local_tensor

    fp8 = pytest.importorskip("torchao.float8.fsdp_utils")
    inner = torch.randn(4, 8)
    wrapped = fp8.WeightWithDynamicFloat8CastTensor(inner, None, torch.float8_e4m3fn, torch.tensor(1.0))
    assert wrapped.data_ptr() == 0 and local_tensor(wrapped) is inner
    two = TwoTensor(torch.randn(4, 8), torch.randn(4, 8))
    assert local_tensor(two) is two
    table = GradTable([two], [0], 2048, in_place=True)
    with pytest.raises(ValueError, match="parameter of type TwoTensor has no storage of its own.*optim.impl=fused"):
        table.load_grads()


# The in-place and SGD table kernels compiled for an H100 (sm_90; Triton's bundled ptxas, no GPU): every stream
# read and written in 16-byte vectors when the host found the addresses aligned.
_PTX = r"""
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trainer.optim import grad_table
def vector_accesses(fn, sig, constexprs):
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t != "constexpr"}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8)).asm["ptx"]
    return [ptx.count("ld.global.v4"), ptx.count("st.global.v4")]
out = {}
table = {"GradPtrs_ptr": "*i64", "BlockTensor_ptr": "*i32", "BlockStart_ptr": "*i64", "Numel_ptr": "*i64",
         "Coefs_ptr": "*fp32"}
for dt, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    tl_dtype = grad_table._TL_DTYPES[torch_dtype]
    common = {"ALIGNED": True, "BLOCK_SIZE": grad_table.BLOCK_SIZE, "PARAM_DTYPE": tl_dtype, "GRAD_DTYPE": tl_dtype}
    sig = {"ParamPtrs_ptr": "*i64", "ExpAvgPtrs_ptr": "*i64", "ExpAvgSqPtrs_ptr": "*i64", **table}
    for stochastic in (False, True) if dt == "bf16" else (False,):  # bf16 master weights: bf16 states, rounded
        flags = {"DECOUPLED": True, "HAS_CLIP": True, "STOCHASTIC": stochastic, **common}
        out["adamw_in_place_" + ("stochastic_" if stochastic else "") + dt] = vector_accesses(
            grad_table._adamw_in_place_kernel, {**sig, **{k: "constexpr" for k in flags}}, flags)
    for in_place in (True, False):
        sig = {"Param_ptr": "*" + dt, "ParamPtrs_ptr": "*i64", "MomentumBuffer_ptr": "*fp32",
               "MomentumBufferPtrs_ptr": "*i64", **table}
        flags = {"IN_PLACE": in_place, "HAS_MOMENTUM": True, "NESTEROV": False, "HAS_CLIP": True, **common}
        out[f"sgd_{'in_place' if in_place else 'table'}_{dt}"] = vector_accesses(
            grad_table._sgd_blocks_kernel, {**sig, **{k: "constexpr" for k in flags}}, flags)
print(json.dumps(out))
"""


def test_table_kernels_lower_to_16_byte_accesses_on_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _PTX], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in r.stderr:
        pytest.skip(f"no ptxas: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # (streams read, streams written): AdamW param, grad, exp_avg, exp_avg_sq / param and both states; SGD param,
    # grad, momentum buffer / param and buffer.
    streams = {"adamw_in_place": (4, 3), "sgd_in_place": (3, 2), "sgd_table": (3, 2)}
    for name, (n_in, n_out) in streams.items():
        for dt in ("fp32", "bf16"):
            loads, stores = out[f"{name}_{dt}"]
            assert loads >= n_in and stores >= n_out, (name, dt, loads, stores)
    loads, stores = out["adamw_in_place_stochastic_bf16"]
    assert loads >= 4 and stores >= 3, (loads, stores)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_gpus_fsdp_triton_reproduce_one_gpu(name, tmp_path):
    """NCCL, the kernels compiled for the GPU: 2 GPUs x 4 sequences with fsdp against 1 GPU x 8, both ours, fp32."""
    common = [
        *COMMON,
        *GPU_CACHE,
        *OPTIMIZERS[name],
        "train.device=cuda",
        "train.precision=fp32",
        "compile.enabled=true",
    ]
    two = [*common, "train.micro_batch_size=4", "distributed.strategy=fsdp", f"run.dir={tmp_path / 'two'}"]
    wait_two = start_torchrun(_fit_cmd(2, *two), env=_env())  # beside the one-process run
    r = cli(None, "fit", "configs/tiny.yaml", *common, "train.micro_batch_size=8", f"run.dir={tmp_path / 'one'}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = wait_two()
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    print(name, "max |loss diff|, 2 GPUs fsdp vs 1:", max(abs(a[s] - b[s]) for s in a))
    for step in a:
        # TF32 matmuls and another summation order: tolerance 1e-3 (relative to losses ~5), as for ddp.
        assert abs(a[step] - b[step]) < 1e-3, (step, a[step], b[step])
    na, nb = metric(tmp_path / "one", "grad_norm"), metric(tmp_path / "two", "grad_norm")
    for step in na:
        assert abs(na[step] - nb[step]) <= 1e-3 * na[step], (step, na[step], nb[step])


@pytest.mark.slow  # a 2-rank run and its resume
def test_bf16_master_weights_on_fsdp_ranks_resume_bit_for_bit(tmp_path):
    """optim.master_weights=bf16 under fsdp on 2 ranks: the in-place kernel keeps each shard's states in bf16 (the
    DCP checkpoint holds them so), and a run resumed from step 5 ends as the run that was not stopped, bit for bit
    (each rank's random bits a function of the step and the element's place in its shard)."""
    args = (
        "optim.master_weights=bf16",
        "train.precision=bf16",
        "distributed.strategy=fsdp",
        "train.micro_batch_size=4",
    )
    _run(2, tmp_path / "whole", *args)
    _run(2, tmp_path / "cut", *args, "train.stop_at=5")
    _run(2, tmp_path / "cut", *args, "resume=last")
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert sorted(a) == sorted(b) == list(range(1, 9)) and a == b, (a, b)
    states = [t for s in _optim_states(tmp_path / "whole", 8) for k, t in s.items() if k != "step"]
    assert states and {t.dtype for t in states} == {torch.bfloat16}
