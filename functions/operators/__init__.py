"""The torch.ops.syncbn operators: their schemas, which kernels serve them, the pure-PyTorch reference, and ours or torch's for a lone replica."""
