"""Fused kernels as ``torch.ops.fxforge.*`` custom ops: a Triton kernel, a torch reference, a fake impl, autograd.

Importing this package registers the ops (``import fxforge`` does it, so checkpoints naming them load);
it never imports triton -- the Triton modules load on the first call that runs them (kernels/dispatch.py).

| op | meaning |
| --- | --- |
| ``softmax(x)`` | ``softmax(x, -1)`` |
| ``scaled_masked_softmax(x, mask, scale)`` | ``softmax(x * scale + mask, -1)`` |
| ``layer_norm(x, w, b, eps)`` | LayerNorm over the last dim |
| ``add_layer_norm(x, r, w, b, eps)`` | ``(layer_norm(x + r), x + r)`` |
| ``bias_gelu(x, b, approximate)`` / ``bias_relu(x, b)`` | ``gelu(x + b)`` / ``relu(x + b)`` |
| ``afno_mlp(x, w1, b1, w2, b2, mask, lambd)`` | AFNO's spectral block MLP + softshrink on (real, imag) pairs |
| ``int8_weight_only_linear(x, w_int8, scale, bias)`` | ``x @ (w_int8 * scale[:, None]).T + bias`` (CPU C++ kernel) |
"""

if __name__ == "fxforge.kernels":
    from .activation import bias_gelu, bias_relu
    from .afno import afno_mlp
    from .dispatch import kernel_backend, triton_available, use_triton
    from .layernorm import add_layer_norm, layer_norm
    from .row_softmax import scaled_masked_softmax, softmax, softmax_backward
    from .woq_int8 import int8_weight_only_linear

    __all__ = ["add_layer_norm", "afno_mlp", "bias_gelu", "bias_relu", "int8_weight_only_linear", "kernel_backend",
               "layer_norm", "scaled_masked_softmax", "softmax", "softmax_backward", "triton_available", "use_triton"]
else:  # pragma: no cover - depends on how Python was started
    # Run from the repository root, this folder is also importable as a top-level ``kernels``, a name
    # transformers probes for (the HF kernels package): that copy stays empty instead of registering
    # the custom ops a second time (which corrupted the dispatcher and crashed the Triton interpreter).
    __all__ = []

