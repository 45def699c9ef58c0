"""The model dtypes a service may be asked for, by their flag spelling."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
