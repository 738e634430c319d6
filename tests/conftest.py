"""Shared test setup: keep torch to one thread per process on the 2-core CI machine."""

import torch

torch.set_num_threads(1)
