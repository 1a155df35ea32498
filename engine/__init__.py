"""ExpertDesk engine: the expert runtime, quant kernels and model forward passes. No Qt."""
