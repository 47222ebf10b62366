"""What is inside model blobs: GGUF and safetensors headers, quantization, and diff of
two models."""
