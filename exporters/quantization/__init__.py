"""Quantization of exported ONNX models (int8 recipes for TensorRT and ONNX Runtime, fp16)."""
