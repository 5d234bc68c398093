"""Every on-disk format liferaft reads (native, PyTorch DCP, safetensors, torch.save) behind one detector and
one reader protocol."""
