"""Quickstart: graph a layer that returns (hidden, None), then train through it."""

import torch

import dualgraph.torch as dgt


class Layer(torch.nn.Module):  # returns (hidden, None), like Megatron's vision layers
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.fc(x)), None


device = "cuda" if torch.cuda.is_available() else "cpu"
sample = torch.randn(8, 64, device=device, requires_grad=True)  # shapes and grad of real calls
layer = dgt.make_graphed_callables(Layer().to(device), (sample,))  # CUDA graphs on a GPU
hidden, aux = layer(torch.randn(8, 64, device=device, requires_grad=True))
hidden.sum().backward()  # grads reach the input and layer.fc
assert aux is None and layer.fc.weight.grad is not None
print(f"{dgt.diagnostics(layer).backend}: hidden {tuple(hidden.shape)}, aux {aux}")
