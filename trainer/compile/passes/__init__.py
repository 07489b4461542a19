"""trainer's Triton kernels (:mod:`trainer.ops`) substituted into any captured graph: no switches inside a model.

A pass over each FX graph that Dynamo captures recognises patterns by what the graph computes, whatever the
model's module names or classes, and replaces them with trainer's ``torch.library`` ops:

- ``add_layer_norm``: ``layer_norm(x + inc, ...)`` (the residual add and the LayerNorm that reads it; the add's
  result stays the residual stream) as one kernel each way; a LayerNorm that reads no add gets the same kernel
  without ``inc``. The bias of the matmul that made ``inc`` moves into the kernel, whose backward already sums
  the column gradients it needs.
- ``add_rms_norm``: the same for RMSNorm, both ``F.rms_norm`` and the hand-written form of Hugging Face's Llama,
  Mistral and Qwen (``h.to(float32)``, ``pow(2).mean(-1, keepdim=True)``, ``rsqrt(var + eps)``, times the weight).
- ``cross_entropy`` / ``linear_cross_entropy``: ``cross_entropy(linear(h, W), targets)`` through views,
  reshapes and a ``.float()`` upcast, with ``ignore_index``: trainer's loss row kernel on the logits (``cross_entropy``:
  logits kept, their gradient written over them in the forward) or the chunked fused linear + cross-entropy that
  never holds the whole logits (``linear_cross_entropy``). With both enabled, the vocabulary decides
  (:data:`~trainer.compile.passes.loss.FUSED_LOSS_MIN_VOCAB`).
- ``causal_attention``: an attention mask built in the graph that equals the causal mask becomes ``is_causal=True``,
  and keys and values repeated to every query head become ``enable_gqa=True``
  (:mod:`~trainer.compile.passes.attention`): SDPA's causal kernels then skip the masked half. Not a trainer kernel:
  it lets torch's fastest one run.

Where it runs: in trainer's Dynamo backend, on the torch-level graph Dynamo hands over, before AOTAutograd. There the
graph still says ``layer_norm``, ``add`` and ``cross_entropy`` (after AOTAutograd they are decomposed into dozens
of aten ops, with the backward already derived), the pass is the same for every backend (Inductor, ``aot_eager``
on a CPU with ``TRITON_INTERPRET=1``), and AOTAutograd then differentiates trainer's ops through their registered
autograd like any op. The distributed layer's graph splitter calls the same backend for each piece, so the pass
runs inside DDP's pieces too (a pattern cut by a piece boundary stays as it was), and inside the bodies of
activation-checkpointed regions (``train.activation_checkpointing``), which Dynamo captures as subgraphs.

Numerics follow the reference: sums and statistics in fp32, outputs rounded once. A near-match whose meaning
differs (no affine weight, a weight of ``1 + w``, eps outside the root, a norm over another dimension, a head
with a bias, logits used elsewhere) is left alone; ``trainer explain --verbose`` lists each with the reason.

The passes: :mod:`~trainer.compile.passes.norms`, :mod:`~trainer.compile.passes.loss` and
:mod:`~trainer.compile.passes.attention`, on what :mod:`~trainer.compile.passes.graph_edit` shares (reading a node,
editing without changing what the graph computes); :mod:`~trainer.compile.passes.substitute` runs them over a graph
and its checkpointed regions, as a Dynamo backend, and logs what they did.
"""

KERNEL_NAMES = ("add_layer_norm", "add_rms_norm", "cross_entropy", "linear_cross_entropy", "causal_attention")
"""The kernels the passes substitute (``compile.kernels`` names them): the one list, which the config schema, the
capture and :func:`~trainer.compile.passes.substitute.substitute` read."""
