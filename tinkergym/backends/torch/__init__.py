"""The torch engine: TorchBackend (sampling, scoring, training, states) on CPU or CUDA."""
