"""`kiln bench`: side-by-side training benchmarks of eager PyTorch, torch.compile and Kiln."""
