"""The model's Triton kernels, one op per file, each with its ``torch.library`` registration (``trainer::<op>``),
fake implementation and autograd, so Dynamo, AOTAutograd and Inductor trace through them:

- :mod:`~trainer.ops.add_layer_norm`: residual add + LayerNorm (``trainer::add_layer_norm``);
- :mod:`~trainer.ops.add_rms_norm`: residual add + RMSNorm (``trainer::add_rms_norm``);
- :mod:`~trainer.ops.linear_cross_entropy`: the head's matmul and the cross-entropy in chunks, or the loss rows of
  logits already computed (``trainer::linear_cross_entropy``, ``trainer::linear_cross_entropy_saved``);
- :mod:`~trainer.ops.utils`: what the kernels share (where Triton runs, the autocast dtype, the row norms' sums).
- :mod:`~trainer.ops.warm`: their kernels compiled in a second process while the model compiles.

The compile layer substitutes them into captured graphs (:mod:`trainer.compile.passes`); nothing here imports it.
Importing this package imports no kernel: under ``TRITON_INTERPRET=1`` the variable must be set before they are
decorated.
"""
