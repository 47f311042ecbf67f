import torch

# Two shared cores: keep every algo test single-threaded.
torch.set_num_threads(1)
