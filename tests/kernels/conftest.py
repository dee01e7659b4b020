"""Triton kernel tests: without CUDA they run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before the test modules import the kernel
modules (they re-import a kernel module that was imported earlier without it)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as _interpreter
    except ImportError:
        _interpreter = None
    if _interpreter is not None and hasattr(_interpreter, "_patch_lang_tensor"):
        # The interpreter holds scalars as 1-element arrays and converts them with int(array), which NumPy >= 2.3
        # refuses for 1-d arrays (`range(lo, hi)` over loaded bounds fails); convert through .item() instead.
        _patch_lang_tensor = _interpreter._patch_lang_tensor

        def _patch_lang_tensor_item(tensor, scope):
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        _interpreter._patch_lang_tensor = _patch_lang_tensor_item
    if _interpreter is not None and hasattr(_interpreter, "InterpreterBuilder"):
        # The interpreter keeps bfloat16 as raw uint16 bits and multiplies those bits in tl.dot; widen to float32
        # first (exact: bf16 -> fp32 loses nothing, and the GPU also accumulates bf16 products in fp32).
        _create_dot = _interpreter.InterpreterBuilder.create_dot

        def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
            import triton.language as tl

            if a.dtype.scalar == tl.bfloat16:
                a = self.cast_impl(a, tl.float32)
            if b.dtype.scalar == tl.bfloat16:
                b = self.cast_impl(b, tl.float32)
            return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

        _interpreter.InterpreterBuilder.create_dot = _create_dot_bf16
        # float32 -> bfloat16 casts truncate in the interpreter; compiled kernels round to nearest even, as torch does.
        _cast_impl = _interpreter.InterpreterBuilder.cast_impl

        def _cast_impl_rtne(self, src, dst_type):
            import numpy as np
            import triton.language as tl

            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                data = np.ascontiguousarray(src.data, dtype=np.float32)
                bits = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                return _interpreter.TensorHandle(bits, tl.bfloat16)
            return _cast_impl(self, src, dst_type)

        _interpreter.InterpreterBuilder.cast_impl = _cast_impl_rtne
        # float32 -> fp8 (e4m3, e5m2) loses the carry when rounding up crosses a power of two (124.1 -> 64, not 128);
        # compiled kernels round to nearest even, as torch does.
        _create_fp_to_fp = _interpreter.InterpreterBuilder.create_fp_to_fp

        def _create_fp_to_fp_e4m3(self, src, dst_type, rounding_mode):
            import numpy as np
            import triton.language as tl

            fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}.get(dst_type.scalar)
            if src.dtype.scalar == tl.float32 and fp8 is not None:
                data = np.ascontiguousarray(src.data, dtype=np.float32)
                bits = torch.from_numpy(data).to(fp8).view(torch.uint8).numpy()
                return _interpreter.TensorHandle(bits, dst_type.scalar)
            return _create_fp_to_fp(self, src, dst_type, rounding_mode)

        _interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp_e4m3
