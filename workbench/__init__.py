"""workbench: experiment-tracked, distributed differentially private training in PyTorch."""
